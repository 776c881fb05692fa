package main

// freeze-node: a node cut off by a brief network partition and then back, with nothing
// killed. For the freeze the agent renews no Lease and posts no node status, its pod workers
// start, restart and report nothing, and every container process is stopped (SIGSTOP to its
// process group), so sidecars do not answer and trainers do not progress. The thaw sends
// SIGCONT to the same processes and renews the Lease and posts the status at once.

import (
	"context"
	"fmt"
	"time"
)

func (a *agent) snapshotWorkers() []*podWorker {
	a.mu.Lock()
	defer a.mu.Unlock()
	workers := make([]*podWorker, 0, len(a.workers))
	for _, w := range a.workers {
		workers = append(workers, w)
	}
	return workers
}

// freeze stops the heartbeat, the pod workers and every container process. When it returns,
// no Lease renewal, node status or pod status is in flight, and none follows until thaw.
func (a *agent) freeze() error {
	a.hbMu.Lock()
	switch {
	case a.dead.Load():
		a.hbMu.Unlock()
		return fmt.Errorf("node %s is dead (killed or preempted): nothing to freeze", a.name)
	case a.frozen.Load():
		a.hbMu.Unlock()
		return fmt.Errorf("node %s is frozen already: wait for its thaw (freeze-node --wait returns after it)", a.name)
	}
	a.frozen.Store(true)
	a.hbMu.Unlock()
	// A worker reconciles under its lock and checks frozen first, so once we hold the lock
	// no container starts on this node and every one started before is signalled here.
	for _, w := range a.snapshotWorkers() {
		w.signalAll(sigstop)
	}
	return nil
}

// thaw resumes what freeze stopped: SIGCONT to the containers (none started meanwhile), then
// the Lease renewed and the node status posted at once, and every pod worker woken. A node
// killed while frozen stays dead: its processes were SIGKILLed and nothing here restarts its
// heartbeat (renewLease and postStatus check dead).
func (a *agent) thaw() {
	if a.dead.Load() {
		return
	}
	workers := a.snapshotWorkers()
	for _, w := range workers {
		w.signalAll(sigcont)
	}
	a.hbMu.Lock()
	a.frozen.Store(false)
	a.hbMu.Unlock()
	a.renewLease()
	a.postStatus()
	for _, w := range workers {
		w.kick()
	}
}

// handleFreezeNode freezes the node for req.Seconds and thaws it in the background (or,
// with req.Wait, before answering).
func (c *cluster) handleFreezeNode(ctx context.Context, req controlRequest) (controlResponse, error) {
	if req.Seconds <= 0 {
		return controlResponse{}, fmt.Errorf("freeze-node needs --seconds S > 0 (got %g)", req.Seconds)
	}
	a, err := c.liveAgent(req.Node)
	if err != nil {
		return controlResponse{}, err
	}
	if err := a.freeze(); err != nil {
		return controlResponse{}, err
	}
	d := time.Duration(req.Seconds * float64(time.Second))
	c.logf("froze node %s for %s", req.Node, d)
	thawed := make(chan struct{})
	go func() {
		defer close(thawed)
		select {
		case <-time.After(d):
		case <-a.ctx.Done():
			// Killed (kill-node, preempt) or `up` stopping while frozen: no thaw.
			return
		}
		a.thaw()
		c.logf("thawed node %s", req.Node)
	}()
	if !req.Wait {
		return controlResponse{Node: req.Node, Message: fmt.Sprintf("frozen for %s", d)}, nil
	}
	select {
	case <-thawed:
	case <-ctx.Done():
	}
	if a.dead.Load() {
		return controlResponse{Node: req.Node, Message: "killed while frozen"}, nil
	}
	return controlResponse{Node: req.Node, Message: fmt.Sprintf("thawed after %s", d)}, nil
}
