"""``baton-sidecar``: the console script that runs the sidecar in each training pod."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from baton_sidecar._config import parse_config
from baton_sidecar._errors import SidecarError
from baton_sidecar._serve import serve

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and environment, then serve until SIGTERM. Returns the exit status."""
    try:
        config = parse_config(argv)
    except SidecarError as e:
        print(f"baton-sidecar: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, config.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        asyncio.run(serve(config))
    except SidecarError as e:
        logging.getLogger("baton_sidecar").error("%s", e)
        return 2
    except OSError as e:
        logging.getLogger("baton_sidecar").error(
            "cannot serve on %s:%d: %s", config.host, config.port, e
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
