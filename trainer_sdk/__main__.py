"""``python -m trainer_sdk``: see :mod:`trainer_sdk.cli`."""

from __future__ import annotations

import sys

from trainer_sdk.cli import main

if __name__ == "__main__":
    sys.exit(main())
