package main

// A pod worker runs one pod's containers as local process groups and reports the pod's
// status the way the kubelet does. The image field is ignored: the command runs on the host.
// This file holds the worker's life cycle (start, restart, termination, node shutdown);
// exec.go builds and starts a container's process, volumes.go materialises volumes,
// probes.go runs readiness probes and status.go reports the pod's status.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

const (
	sigterm = syscall.SIGTERM
	sigkill = syscall.SIGKILL
	sigstop = syscall.SIGSTOP
	sigcont = syscall.SIGCONT
	// serviceAccountMountPath is where the ServiceAccount admission plugin mounts the token.
	serviceAccountMountPath = "/var/run/secrets/kubernetes.io/serviceaccount"
	maxBackoff              = 20 * time.Second
	setupRetryFirst         = 100 * time.Millisecond // a failed volume setup's first retry
	setupRetryMax           = time.Second            // and its longest wait between tries
)

type containerKind int

const (
	kindInit containerKind = iota
	kindSidecar
	kindMain
)

type containerRun struct {
	spec        corev1.Container
	kind        containerKind
	cmd         *exec.Cmd
	pgid        int
	running     bool
	everStarted bool
	exited      chan struct{}
	startedAt   time.Time
	term        *corev1.ContainerStateTerminated
	lastTerm    *corev1.ContainerStateTerminated
	restarts    int32
	nextStart   time.Time
	waitReason  string
	waitMessage string
	ready       bool
	probeCancel context.CancelFunc
	logPaths    []string
	containerID string
	env         []string
	workDir     string
}

type podWorker struct {
	a     *agent
	uid   types.UID
	mu    sync.Mutex
	pod   *corev1.Pod
	poke  chan struct{}
	dir   string
	podIP string
	start metav1.Time

	setupDone   bool
	setupErr    error
	nextSetup   time.Time
	setupWait   time.Duration // the wait before the next try of a failed setup (doubling)
	volDirs     map[string]string
	kubeconfigs map[string]string // volume name -> kubeconfig path for SA-token volumes
	tokenAt     time.Time

	ctrs        []*containerRun
	initialized bool
	finished    bool
	finalPhase  corev1.PodPhase

	terminating   bool
	sidecarsTermd bool
	termDeadline  time.Time
	shutdownMode  bool
	gone          bool
	shutdownDone  bool

	transitions map[corev1.PodConditionType]condState
	lastPushed  []byte
}

func newPodWorker(a *agent, pod *corev1.Pod) *podWorker {
	w := &podWorker{
		a: a, uid: pod.UID, pod: pod.DeepCopy(), poke: make(chan struct{}, 1),
		dir: filepath.Join(a.c.dir, podDirName(pod)), start: metav1.Now(),
		volDirs: map[string]string{}, kubeconfigs: map[string]string{},
		transitions: map[corev1.PodConditionType]condState{},
	}
	// A pod that already has an IP (the agent restarted) keeps it; else a fresh loopback one.
	if pod.Status.PodIP != "" {
		w.podIP = pod.Status.PodIP
	} else {
		w.podIP = a.c.allocatePodIP()
	}
	if pod.Status.StartTime != nil {
		w.start = *pod.Status.StartTime
	}
	for _, c := range pod.Spec.InitContainers {
		k := kindInit
		if c.RestartPolicy != nil && *c.RestartPolicy == corev1.ContainerRestartPolicyAlways {
			k = kindSidecar
		}
		w.ctrs = append(w.ctrs, &containerRun{spec: c, kind: k})
	}
	for _, c := range pod.Spec.Containers {
		w.ctrs = append(w.ctrs, &containerRun{spec: c, kind: kindMain})
	}
	return w
}

func (w *podWorker) kick() {
	select {
	case w.poke <- struct{}{}:
	default:
	}
}

func (w *podWorker) update(pod *corev1.Pod) {
	w.mu.Lock()
	w.pod = pod.DeepCopy()
	w.mu.Unlock()
	w.kick()
}

func (w *podWorker) removedFromAPI() {
	w.mu.Lock()
	w.gone = true
	w.mu.Unlock()
	w.kick()
}

func (w *podWorker) currentPod() *corev1.Pod {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pod
}

func (w *podWorker) run() {
	defer w.a.forget(w.uid)
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		if w.reconcile() {
			return
		}
		select {
		case <-w.poke:
		case <-t.C:
		case <-w.a.ctx.Done():
			return
		}
	}
}

func (w *podWorker) logf(format string, args ...any) {
	w.a.logf("pod %s/%s: %s", w.pod.Namespace, w.pod.Name, fmt.Sprintf(format, args...))
}

// reconcile advances the pod one step; it returns true when the worker is finished.
func (w *podWorker) reconcile() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.a.dead.Load() {
		return true
	}
	if w.a.frozen.Load() {
		// Cut off (freeze.go): nothing is started, stopped or reported until the thaw, which
		// kicks every worker.
		return false
	}
	pod := w.pod
	if w.gone {
		// Force-deleted (or deleted by pod GC): nobody waits for a status any more.
		w.signalLocked(sigterm, nil)
		w.mu.Unlock()
		w.waitAllExited(2 * time.Second)
		w.signalAll(sigkill)
		w.waitAllExited(5 * time.Second)
		w.mu.Lock()
		w.cleanup()
		return true
	}
	if pod.DeletionTimestamp != nil && !w.terminating {
		grace := int64(30)
		if pod.DeletionGracePeriodSeconds != nil {
			grace = *pod.DeletionGracePeriodSeconds
		}
		w.beginTermination(time.Duration(grace) * time.Second)
	}
	if w.terminating {
		if !w.driveTermination() {
			w.pushStatus()
			return false
		}
		if w.shutdownMode && pod.DeletionTimestamp == nil {
			if !w.shutdownDone {
				w.finished, w.finalPhase = true, corev1.PodFailed
				w.pushStatus()
				w.shutdownDone = true
			}
			return false
		}
		if !w.finished {
			w.finished, w.finalPhase = true, w.terminalPhase()
		}
		w.pushStatus()
		err := w.a.client.CoreV1().Pods(pod.Namespace).Delete(w.a.ctx, pod.Name, metav1.DeleteOptions{
			GracePeriodSeconds: ptr.To[int64](0),
			Preconditions:      &metav1.Preconditions{UID: &w.uid},
		})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			if w.a.ctx.Err() == nil {
				w.logf("final delete: %v (retrying)", err)
			}
			return false
		}
		w.cleanup()
		return true
	}
	if w.finished {
		w.pushStatus()
		return false
	}
	if w.a.shutdown.Load() {
		return false
	}
	if !w.setupDone {
		if time.Now().Before(w.nextSetup) {
			return false
		}
		if err := w.setup(); err != nil {
			// Most often the Node authorizer has not yet seen the binding (a Secret read
			// "forbidden: no relationship found between node ... and this object" a few ms
			// after it), which a retry a moment later clears: retry after 100 ms, doubling to
			// 1 s, and wake the worker then rather than at its next 500 ms tick. A flat 1 s
			// (1.5 s with the tick) started one pod of a gang that much after its peers, and
			// every rank waited for it in the rendezvous.
			w.setupErr = err
			w.setupWait = min(max(2*w.setupWait, setupRetryFirst), setupRetryMax)
			w.nextSetup = time.Now().Add(w.setupWait)
			time.AfterFunc(w.setupWait, w.kick)
			w.pushStatus()
			return false
		}
		w.setupDone, w.setupErr = true, nil
	}
	if !w.tokenAt.IsZero() && time.Now().After(w.tokenAt) {
		if err := w.setupVolumes(true); err != nil {
			w.logf("token refresh: %v", err)
		}
	}
	w.step()
	w.pushStatus()
	return false
}

func (w *podWorker) restartPolicy() corev1.RestartPolicy {
	if w.pod.Spec.RestartPolicy == "" {
		return corev1.RestartPolicyAlways
	}
	return w.pod.Spec.RestartPolicy
}

// step starts, restarts and finishes containers in the kubelet's order: init containers one
// by one (sidecars stay running), then all main containers.
func (w *podWorker) step() {
	now := time.Now()
	for _, cr := range w.ctrs {
		if cr.kind == kindMain {
			continue
		}
		if cr.kind == kindSidecar {
			if !cr.running && now.After(cr.nextStart) {
				w.startContainer(cr)
			}
			if !cr.everStarted {
				return
			}
			continue
		}
		if cr.term != nil && cr.term.ExitCode == 0 && !cr.running {
			continue
		}
		if cr.running {
			return
		}
		if cr.term != nil && w.restartPolicy() == corev1.RestartPolicyNever {
			w.finish(corev1.PodFailed)
			return
		}
		if now.After(cr.nextStart) {
			w.startContainer(cr)
		}
		return
	}
	w.initialized = true
	allDone := true
	for _, cr := range w.ctrs {
		if cr.kind != kindMain {
			continue
		}
		if cr.running {
			allDone = false
			continue
		}
		if !cr.everStarted || w.shouldRestart(cr) {
			allDone = false
			if now.After(cr.nextStart) {
				w.startContainer(cr)
			}
		}
	}
	if allDone {
		w.finish(w.terminalPhase())
	}
}

func (w *podWorker) shouldRestart(cr *containerRun) bool {
	if cr.term == nil {
		return true
	}
	// Kubernetes 1.35+ (ContainerRestartRules, beta, on by default): a regular container's
	// own rules are checked in order, the first match wins; then its own restartPolicy, when
	// set, overrides the pod's (pkg/kubelet/container's ShouldContainerBeRestarted).
	code := cr.term.ExitCode
	for _, rule := range cr.spec.RestartPolicyRules {
		if rule.Action == corev1.ContainerRestartRuleActionRestart && rule.ExitCodes != nil &&
			exitCodeMatches(rule.ExitCodes, code) {
			return true
		}
	}
	policy := w.restartPolicy()
	if cr.kind == kindMain && cr.spec.RestartPolicy != nil {
		policy = corev1.RestartPolicy(*cr.spec.RestartPolicy)
	}
	switch policy {
	case corev1.RestartPolicyAlways:
		return true
	case corev1.RestartPolicyOnFailure:
		return code != 0
	default:
		return false
	}
}

// exitCodeMatches evaluates a restart rule's exitCodes requirement (In / NotIn).
func exitCodeMatches(req *corev1.ContainerRestartRuleOnExitCodes, code int32) bool {
	in := false
	for _, v := range req.Values {
		if v == code {
			in = true
			break
		}
	}
	if req.Operator == corev1.ContainerRestartRuleOnExitCodesOpNotIn {
		return !in
	}
	return req.Operator == corev1.ContainerRestartRuleOnExitCodesOpIn && in
}

func (w *podWorker) terminalPhase() corev1.PodPhase {
	for _, cr := range w.ctrs {
		if cr.kind == kindMain && (cr.term == nil || cr.term.ExitCode != 0) {
			return corev1.PodFailed
		}
	}
	return corev1.PodSucceeded
}

// finish makes the pod terminal and stops its sidecars in reverse order, after the main
// containers, as the kubelet does.
func (w *podWorker) finish(phase corev1.PodPhase) {
	w.finished, w.finalPhase = true, phase
	grace := int64(30)
	if w.pod.Spec.TerminationGracePeriodSeconds != nil {
		grace = *w.pod.Spec.TerminationGracePeriodSeconds
	}
	var sidecars []*containerRun
	for i := len(w.ctrs) - 1; i >= 0; i-- {
		if w.ctrs[i].kind == kindSidecar && w.ctrs[i].running {
			sidecars = append(sidecars, w.ctrs[i])
		}
	}
	if len(sidecars) == 0 {
		return
	}
	go func() {
		deadline := time.Now().Add(time.Duration(grace) * time.Second)
		for _, cr := range sidecars {
			w.mu.Lock()
			pgid, ch := cr.pgid, cr.exited
			w.mu.Unlock()
			_ = syscall.Kill(-pgid, sigterm)
			select {
			case <-ch:
			case <-time.After(time.Until(deadline)):
				_ = syscall.Kill(-pgid, sigkill)
				<-ch
			}
		}
		w.kick()
	}()
}

func (w *podWorker) beginTermination(grace time.Duration) {
	w.terminating = true
	w.termDeadline = time.Now().Add(grace)
	w.signalLocked(sigterm, func(cr *containerRun) bool { return cr.kind != kindSidecar })
}

// driveTermination moves a terminating pod on: sidecars get SIGTERM once the other
// containers are gone, and everything left gets SIGKILL at the deadline.
func (w *podWorker) driveTermination() bool {
	others := false
	for _, cr := range w.ctrs {
		if cr.kind != kindSidecar && cr.running {
			others = true
		}
	}
	if !others && !w.sidecarsTermd {
		w.sidecarsTermd = true
		for i := len(w.ctrs) - 1; i >= 0; i-- {
			if cr := w.ctrs[i]; cr.kind == kindSidecar && cr.running {
				_ = syscall.Kill(-cr.pgid, sigterm)
			}
		}
	}
	if time.Now().After(w.termDeadline) {
		w.signalLocked(sigkill, nil)
	}
	for _, cr := range w.ctrs {
		if cr.running {
			return false
		}
	}
	return true
}

func (w *podWorker) nodeShutdown(grace time.Duration) {
	w.mu.Lock()
	if !w.terminating {
		podGrace := int64(30)
		if w.pod.Spec.TerminationGracePeriodSeconds != nil {
			podGrace = *w.pod.Spec.TerminationGracePeriodSeconds
		}
		g := time.Duration(podGrace) * time.Second
		if grace < g {
			g = grace
		}
		w.shutdownMode = true
		w.beginTermination(g)
	}
	w.mu.Unlock()
	w.kick()
}

func (w *podWorker) signalLocked(sig syscall.Signal, filter func(*containerRun) bool) {
	for _, cr := range w.ctrs {
		if cr.running && (filter == nil || filter(cr)) {
			_ = syscall.Kill(-cr.pgid, sig)
		}
	}
}

func (w *podWorker) signalAll(sig syscall.Signal) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.signalLocked(sig, nil)
}

func (w *podWorker) anyRunning() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, cr := range w.ctrs {
		if cr.running {
			return true
		}
	}
	return false
}

func (w *podWorker) waitAllExited(timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for w.anyRunning() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
}

func (w *podWorker) containerRunning(name string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, cr := range w.ctrs {
		if cr.spec.Name == name {
			return cr.running
		}
	}
	return false
}

func (w *podWorker) logPath(name string, previous bool) (string, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, cr := range w.ctrs {
		if cr.spec.Name != name {
			continue
		}
		n := len(cr.logPaths)
		if previous {
			n--
		}
		if n <= 0 {
			return "", false
		}
		return cr.logPaths[n-1], true
	}
	return "", false
}

func (w *podWorker) cleanup() {
	// Volumes may hold secrets; logs stay under DIR/logs for post-mortems.
	_ = os.RemoveAll(filepath.Join(w.dir, "volumes"))
	_ = os.RemoveAll(filepath.Join(w.dir, "kubeconfigs"))
	w.dropMemoryVolumes()
}

// backoff is how long a container that has exited waits before it starts again, given how
// many times it has restarted. As in the kubelet (kuberuntime's doBackOff: a container with no
// back-off entry yet is not in back-off), the first exit restarts at once; the back-off starts
// at the second (1 s here, 10 s in the kubelet) and doubles.
func backoff(restarts int32) time.Duration {
	if restarts == 0 {
		return 0
	}
	d := time.Second
	for i := int32(1); i < restarts && d < maxBackoff; i++ {
		d *= 2
	}
	if d > maxBackoff {
		d = maxBackoff
	}
	return d
}
