package main

// Faults on demand: the `up` process listens on DIR/control.sock and applies provider
// notices, node loss and new nodes when the CLI subcommands ask.

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/util/retry"
)

type controlRequest struct {
	Node       string  `json:"node,omitempty"`
	Provider   string  `json:"provider,omitempty"`
	Grace      int     `json:"grace,omitempty"`
	Wait       bool    `json:"wait,omitempty"`
	CordonOnly bool    `json:"cordonOnly,omitempty"`
	Spot       bool    `json:"spot,omitempty"`
	Seconds    float64 `json:"seconds,omitempty"`
}

type controlResponse struct {
	Node    string   `json:"node,omitempty"`
	Message string   `json:"message,omitempty"`
	Error   string   `json:"error,omitempty"`
	Nodes   []string `json:"nodes,omitempty"`
}

// Provider notices, as the real components write them.
const (
	// AWS Node Termination Handler: TaintSpotItn and MarkWithEventID in its pkg/node.
	awsSpotITNTaint    = "aws-node-termination-handler/spot-itn"
	awsEventIDLabel    = "aws-node-termination-handler/event-id"
	gkeImpendingTaint  = "cloud.google.com/impending-node-termination"
	karpenterTaint     = "karpenter.sh/disrupted"
	autoscalerTaint    = "ToBeDeletedByClusterAutoscaler"
	maxTaintValueChars = 63
)

func (c *cluster) serveControl() error {
	sock := controlSocketPath(c.dir)
	_ = os.Remove(sock)
	l, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	c.controlSock = sock
	mux := http.NewServeMux()
	handle := func(path string, fn func(context.Context, controlRequest) (controlResponse, error)) {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			var req controlRequest
			if r.Body != nil {
				_ = json.NewDecoder(r.Body).Decode(&req)
			}
			resp, err := fn(r.Context(), req)
			w.Header().Set("Content-Type", "application/json")
			if err != nil {
				resp.Error = err.Error()
				w.WriteHeader(http.StatusBadRequest)
			}
			_ = json.NewEncoder(w).Encode(resp)
		})
	}
	handle("/preempt", c.handlePreempt)
	handle("/kill-node", c.handleKillNode)
	handle("/add-node", c.handleAddNode)
	handle("/freeze-node", c.handleFreezeNode)
	handle("/stop-apiserver", func(context.Context, controlRequest) (controlResponse, error) {
		took, err := c.stopAPIServer()
		return controlResponse{Message: fmt.Sprintf("kube-apiserver stopped after %.1fs", took.Seconds())}, err
	})
	handle("/start-apiserver", func(context.Context, controlRequest) (controlResponse, error) {
		took, err := c.startAPIServer()
		return controlResponse{Message: fmt.Sprintf("kube-apiserver ready after %.1fs", took.Seconds())}, err
	})
	handle("/nodes", func(context.Context, controlRequest) (controlResponse, error) {
		c.mu.Lock()
		defer c.mu.Unlock()
		var names []string
		for n, a := range c.agents {
			if !a.dead.Load() {
				names = append(names, n)
			}
		}
		sort.Strings(names)
		return controlResponse{Nodes: names}, nil
	})
	c.httpServe(l, mux)
	return nil
}

func (c *cluster) liveAgent(name string) (*agent, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	a, ok := c.agents[name]
	if !ok || a.dead.Load() {
		return nil, fmt.Errorf("no live node %q in this cluster", name)
	}
	return a, nil
}

func (c *cluster) handleAddNode(ctx context.Context, req controlRequest) (controlResponse, error) {
	name, err := c.addNode(req.Spot)
	if err != nil {
		return controlResponse{}, err
	}
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		n, err := c.admin.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			for _, cond := range n.Status.Conditions {
				if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue {
					return controlResponse{Node: name, Message: "Ready"}, nil
				}
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	return controlResponse{Node: name}, fmt.Errorf("node %s not Ready within 60s", name)
}

// handleKillNode is node loss without notice: processes die, the heartbeat stops, and the
// Node object stays for the node-lifecycle controller to find.
func (c *cluster) handleKillNode(_ context.Context, req controlRequest) (controlResponse, error) {
	a, err := c.liveAgent(req.Node)
	if err != nil {
		return controlResponse{}, err
	}
	a.killAll(0)
	c.logf("killed node %s without notice", req.Node)
	return controlResponse{Node: req.Node, Message: "killed"}, nil
}

func (c *cluster) addTaint(ctx context.Context, node string, taint corev1.Taint, labels map[string]string, cordon bool) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := c.admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		taint.TimeAdded = &now
		kept := n.Spec.Taints[:0]
		for _, t := range n.Spec.Taints {
			if t.Key != taint.Key || t.Effect != taint.Effect {
				kept = append(kept, t)
			}
		}
		n.Spec.Taints = append(kept, taint)
		if n.Labels == nil {
			n.Labels = map[string]string{}
		}
		for k, v := range labels {
			n.Labels[k] = v
		}
		if cordon {
			n.Spec.Unschedulable = true
		}
		_, err = c.admin.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		return err
	})
}

// drain evicts the node's pods through the Eviction API (so PodDisruptionBudgets apply),
// retrying refused evictions until the deadline, as `kubectl drain` and its users do.
func (c *cluster) drain(node string, deadline time.Time) {
	ctx, cancel := context.WithDeadline(c.ctx, deadline)
	defer cancel()
	evicted := map[string]bool{}
	for ctx.Err() == nil {
		pods, err := c.admin.CoreV1().Pods("").List(ctx, metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("spec.nodeName", node).String(),
		})
		if err != nil {
			time.Sleep(time.Second)
			continue
		}
		pending := 0
		for _, p := range pods.Items {
			if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed || p.DeletionTimestamp != nil {
				continue
			}
			if ref := metav1.GetControllerOf(&p); ref != nil && ref.Kind == "DaemonSet" {
				continue
			}
			key := string(p.UID)
			if evicted[key] {
				continue
			}
			err := c.admin.PolicyV1().Evictions(p.Namespace).Evict(ctx, &policyv1.Eviction{
				ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace},
			})
			switch {
			case err == nil || apierrors.IsNotFound(err):
				evicted[key] = true
			default:
				pending++
				c.logf("drain %s: evicting %s/%s: %v (retrying)", node, p.Namespace, p.Name, err)
			}
		}
		if pending == 0 {
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Second):
		}
	}
}

func (c *cluster) handlePreempt(ctx context.Context, req controlRequest) (controlResponse, error) {
	a, err := c.liveAgent(req.Node)
	if err != nil {
		return controlResponse{}, err
	}
	grace := time.Duration(req.Grace) * time.Second
	deadline := time.Now().Add(grace)
	var msg string
	drain := !req.CordonOnly
	switch req.Provider {
	case "aws":
		// NTH's spot-interruption path: taint with the event id, label the node with the
		// event id, cordon, then drain (unless run with --cordon-only).
		b := make([]byte, 16)
		_, _ = rand.Read(b)
		eventID := "spot-itn-" + hex.EncodeToString(b)
		if len(eventID) > maxTaintValueChars {
			eventID = eventID[:maxTaintValueChars]
		}
		err = c.addTaint(ctx, req.Node, corev1.Taint{Key: awsSpotITNTaint, Value: eventID, Effect: corev1.TaintEffectNoSchedule},
			map[string]string{awsEventIDLabel: eventID}, true)
		msg = "aws spot interruption notice, event " + eventID
	case "gke":
		// GKE's node maintenance handler taints the node; the kubelet's graceful node
		// shutdown then terminates pods, which end Failed with a DisruptionTarget condition.
		err = c.addTaint(ctx, req.Node, corev1.Taint{Key: gkeImpendingTaint, Effect: corev1.TaintEffectNoSchedule}, nil, false)
		drain = false
		msg = "gke impending node termination"
		if err == nil {
			go a.gracefulShutdown(grace)
		}
	case "karpenter":
		err = c.addTaint(ctx, req.Node, corev1.Taint{Key: karpenterTaint, Effect: corev1.TaintEffectNoSchedule}, nil, false)
		msg = "karpenter disruption"
	case "autoscaler":
		err = c.addTaint(ctx, req.Node, corev1.Taint{Key: autoscalerTaint, Value: strconv.FormatInt(time.Now().Unix(), 10), Effect: corev1.TaintEffectNoSchedule}, nil, false)
		msg = "cluster-autoscaler scale-down"
	default:
		return controlResponse{}, fmt.Errorf("unknown provider %q: use aws, gke, karpenter or autoscaler", req.Provider)
	}
	if err != nil {
		return controlResponse{}, fmt.Errorf("notice on %s: %w", req.Node, err)
	}
	c.logf("preempt %s: %s; node goes away in %s", req.Node, msg, grace)
	if drain {
		go c.drain(req.Node, deadline)
	}
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		select {
		case <-time.After(time.Until(deadline)):
		case <-c.ctx.Done():
			return
		}
		// The machine stops: processes die, the heartbeat ends, then the cloud's node
		// controller deletes the Node object and pod GC cleans up its pods.
		a.killAll(0)
		// The cloud's node controller keeps trying (the API server may be down just then).
		for {
			err := c.admin.CoreV1().Nodes().Delete(c.ctx, req.Node, metav1.DeleteOptions{})
			if err == nil || apierrors.IsNotFound(err) {
				c.logf("preempt %s: machine gone, Node deleted", req.Node)
				return
			}
			c.logf("preempt %s: machine gone, deleting the Node: %v (retrying)", req.Node, err)
			select {
			case <-c.ctx.Done():
				return
			case <-time.After(time.Second):
			}
		}
	}()
	if req.Wait {
		select {
		case <-gone:
		case <-ctx.Done():
		}
	}
	return controlResponse{Node: req.Node, Message: msg}, nil
}

// controlCall sends a request to a running `up` through DIR/control.sock.
func controlCall(dir, path string, req controlRequest) (controlResponse, error) {
	sock := controlSocketPath(dir)
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
	body, _ := json.Marshal(req)
	resp, err := client.Post("http://localcluster"+path, "application/json", bytes.NewReader(body))
	if err != nil {
		return controlResponse{}, fmt.Errorf("no running cluster at %s (is `localcluster up --dir %s` running?): %w", dir, dir, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	var out controlResponse
	if err := json.Unmarshal(data, &out); err != nil {
		return controlResponse{}, fmt.Errorf("bad reply from cluster: %s", data)
	}
	if out.Error != "" {
		return out, fmt.Errorf("%s", out.Error)
	}
	return out, nil
}

// controlSocketPath is DIR/control.sock, or a short path under the temp dir named by DIR's
// hash when DIR is too long for a unix socket address (108 bytes on Linux).
func controlSocketPath(dir string) string {
	abs, err := filepath.Abs(dir)
	if err != nil {
		abs = dir
	}
	sock := filepath.Join(abs, "control.sock")
	if len(sock) < 100 {
		return sock
	}
	sum := sha256.Sum256([]byte(abs))
	return filepath.Join(os.TempDir(), "localcluster-"+hex.EncodeToString(sum[:8])+".sock")
}
