package main

// A pod worker runs one pod's containers as local process groups and reports the pod's
// status the way the kubelet does. The image field is ignored: the command runs on the host.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/kubernetes/third_party/forked/golang/expansion"
	"k8s.io/utils/ptr"
)

const (
	sigterm = syscall.SIGTERM
	sigkill = syscall.SIGKILL
	// serviceAccountMountPath is where the ServiceAccount admission plugin mounts the token.
	serviceAccountMountPath = "/var/run/secrets/kubernetes.io/serviceaccount"
	maxBackoff              = 20 * time.Second
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

type condState struct {
	status corev1.ConditionStatus
	at     metav1.Time
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
			w.setupErr = err
			w.nextSetup = time.Now().Add(time.Second)
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
	switch w.restartPolicy() {
	case corev1.RestartPolicyAlways:
		return true
	case corev1.RestartPolicyOnFailure:
		return cr.term.ExitCode != 0
	default:
		return false
	}
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
}

func backoff(restarts int32) time.Duration {
	d := time.Second
	for i := int32(0); i < restarts && d < maxBackoff; i++ {
		d *= 2
	}
	if d > maxBackoff {
		d = maxBackoff
	}
	return d
}

func (w *podWorker) startContainer(cr *containerRun) {
	if cr.everStarted {
		cr.restarts++
		cr.lastTerm, cr.term = cr.term, nil
	}
	argv, env, workDir, err := w.buildExec(cr.spec)
	if err != nil {
		cr.waitReason, cr.waitMessage = "CreateContainerConfigError", err.Error()
		cr.nextStart = time.Now().Add(time.Second)
		if cr.everStarted {
			cr.restarts--
			cr.term, cr.lastTerm = cr.lastTerm, nil
		}
		return
	}
	logDir := filepath.Join(w.a.c.dir, "logs", podDirName(w.pod), cr.spec.Name)
	_ = os.MkdirAll(logDir, 0o755)
	logPath := filepath.Join(logDir, fmt.Sprintf("%d.log", cr.restarts))
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		cr.waitReason, cr.waitMessage = "CreateContainerError", err.Error()
		return
	}
	if err := os.MkdirAll(workDir, 0o755); err != nil {
		logFile.Close()
		cr.waitReason, cr.waitMessage = "CreateContainerError", fmt.Sprintf("working directory %s: %v", workDir, err)
		cr.nextStart = time.Now().Add(time.Second)
		return
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env, cmd.Dir, cmd.Stdout, cmd.Stderr = env, workDir, logFile, logFile
	// Own process group, so signals reach the whole container; Pdeathsig kills it if the
	// agent's process dies abruptly.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cr.logPaths = append(cr.logPaths, logPath)
	cr.everStarted = true
	now := time.Now()
	if err := cmd.Start(); err != nil {
		logFile.Close()
		cr.term = &corev1.ContainerStateTerminated{ExitCode: 128, Reason: "StartError", Message: err.Error(), StartedAt: metav1.NewTime(now), FinishedAt: metav1.NewTime(now)}
		cr.nextStart = now.Add(backoff(cr.restarts))
		return
	}
	cr.cmd, cr.pgid, cr.running, cr.startedAt = cmd, cmd.Process.Pid, true, now
	cr.waitReason, cr.waitMessage = "", ""
	cr.env, cr.workDir = env, workDir
	cr.containerID = fmt.Sprintf("localcluster://%s-%s-%d", w.uid, cr.spec.Name, cr.restarts)
	cr.exited = make(chan struct{})
	cr.ready = cr.spec.ReadinessProbe == nil
	if cr.spec.ReadinessProbe != nil {
		ctx, cancel := context.WithCancel(w.a.ctx)
		cr.probeCancel = cancel
		go w.probeLoop(ctx, cr, *cr.spec.ReadinessProbe)
	}
	exited := cr.exited
	go func() {
		waitErr := cmd.Wait()
		logFile.Close()
		// When a container's main process exits, the rest of the container goes with it.
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		code := int32(0)
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok {
			if ws.Signaled() {
				code = 128 + int32(ws.Signal())
			} else {
				code = int32(ws.ExitStatus())
			}
		} else if waitErr != nil {
			code = 1
		}
		reason := "Completed"
		if code != 0 {
			reason = "Error"
		}
		end := time.Now()
		w.mu.Lock()
		cr.running, cr.ready = false, false
		if cr.probeCancel != nil {
			cr.probeCancel()
			cr.probeCancel = nil
		}
		cr.term = &corev1.ContainerStateTerminated{
			ExitCode: code, Reason: reason, StartedAt: metav1.NewTime(now), FinishedAt: metav1.NewTime(end),
			ContainerID: cr.containerID,
		}
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			cr.term.Signal = int32(ws.Signal())
		}
		// Back off from crash loops; a container that ran a while restarts promptly.
		if end.Sub(now) > 10*time.Minute {
			cr.nextStart = end
		} else {
			cr.nextStart = end.Add(backoff(cr.restarts))
		}
		close(exited)
		w.mu.Unlock()
		w.kick()
	}()
}

func (w *podWorker) probeLoop(ctx context.Context, cr *containerRun, p corev1.Probe) {
	period := time.Duration(max(p.PeriodSeconds, 1)) * time.Second
	timeout := time.Duration(max(p.TimeoutSeconds, 1)) * time.Second
	success, failure := max(p.SuccessThreshold, 1), max(p.FailureThreshold, 1)
	select {
	case <-ctx.Done():
		return
	case <-time.After(time.Duration(p.InitialDelaySeconds) * time.Second):
	}
	var okRun, failRun int32
	for {
		ok := w.probeOnce(ctx, cr, p, timeout)
		if ok {
			okRun, failRun = okRun+1, 0
		} else {
			okRun, failRun = 0, failRun+1
		}
		w.mu.Lock()
		changed := false
		if ok && okRun >= success && !cr.ready {
			cr.ready, changed = true, true
		}
		if !ok && failRun >= failure && cr.ready {
			cr.ready, changed = false, true
		}
		w.mu.Unlock()
		if changed {
			w.kick()
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(period):
		}
	}
}

func (w *podWorker) resolvePort(spec corev1.Container, port intstr.IntOrString) string {
	if port.Type == intstr.Int {
		return strconv.Itoa(port.IntValue())
	}
	for _, p := range spec.Ports {
		if p.Name == port.StrVal {
			return strconv.Itoa(int(p.ContainerPort))
		}
	}
	return port.StrVal
}

func (w *podWorker) probeOnce(ctx context.Context, cr *containerRun, p corev1.Probe, timeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	switch {
	case p.HTTPGet != nil:
		host := p.HTTPGet.Host
		if host == "" {
			host = w.podIP
		}
		scheme := strings.ToLower(string(p.HTTPGet.Scheme))
		if scheme == "" {
			scheme = "http"
		}
		u := fmt.Sprintf("%s://%s%s", scheme, net.JoinHostPort(host, w.resolvePort(cr.spec, p.HTTPGet.Port)), p.HTTPGet.Path)
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			return false
		}
		for _, h := range p.HTTPGet.HTTPHeaders {
			req.Header.Add(h.Name, h.Value)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode >= 200 && resp.StatusCode < 400
	case p.TCPSocket != nil:
		host := p.TCPSocket.Host
		if host == "" {
			host = w.podIP
		}
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort(host, w.resolvePort(cr.spec, p.TCPSocket.Port)))
		if err != nil {
			return false
		}
		conn.Close()
		return true
	case p.Exec != nil && len(p.Exec.Command) > 0:
		w.mu.Lock()
		env, dir := cr.env, cr.workDir
		argv := make([]string, len(p.Exec.Command))
		for i, a := range p.Exec.Command {
			argv[i] = w.translate(cr.spec, a)
		}
		w.mu.Unlock()
		exe, err := lookPath(argv[0], envValue(env, "PATH"))
		if err != nil {
			return false
		}
		cmd := exec.CommandContext(ctx, exe, argv[1:]...)
		cmd.Env, cmd.Dir = env, dir
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		return cmd.Run() == nil
	}
	return true
}

func envValue(env []string, key string) string {
	for i := len(env) - 1; i >= 0; i-- {
		if k, v, ok := strings.Cut(env[i], "="); ok && k == key {
			return v
		}
	}
	return ""
}

// lookPath resolves name through a PATH value (not this process's PATH).
func lookPath(name, path string) (string, error) {
	if strings.Contains(name, "/") {
		if st, err := os.Stat(name); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return name, nil
		}
		return "", fmt.Errorf("executable %s not found", name)
	}
	for _, d := range filepath.SplitList(path) {
		if d == "" {
			continue
		}
		p := filepath.Join(d, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("executable %q not found in PATH %s", name, path)
}

// mountFor returns the host directory that stands for path inside the container, using
// the longest matching volumeMount.
func (w *podWorker) translate(spec corev1.Container, v string) string {
	if strings.HasPrefix(v, "-") {
		// --flag=/mount/path is translated after the '='.
		if k, rest, ok := strings.Cut(v, "="); ok {
			if t := w.translate(spec, rest); t != rest {
				return k + "=" + t
			}
		}
		return v
	}
	mounts := append([]corev1.VolumeMount(nil), spec.VolumeMounts...)
	sort.Slice(mounts, func(i, j int) bool { return len(mounts[i].MountPath) > len(mounts[j].MountPath) })
	for _, m := range mounts {
		mp := strings.TrimRight(m.MountPath, "/")
		if mp == "" {
			continue
		}
		if v == mp || strings.HasPrefix(v, mp+"/") {
			host, ok := w.volDirs[m.Name]
			if !ok {
				continue
			}
			if m.SubPath != "" {
				host = filepath.Join(host, m.SubPath)
			}
			return host + strings.TrimPrefix(v, mp)
		}
	}
	return v
}

func upperSnake(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z':
			b.WriteRune(r - 'a' + 'A')
		case (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9'):
			b.WriteRune(r)
		default:
			b.WriteRune('_')
		}
	}
	return b.String()
}

// fieldValue resolves a downward-API fieldRef path.
func (w *podWorker) fieldValue(path string) (string, error) {
	p := w.pod
	formatMap := func(m map[string]string) string {
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		lines := make([]string, 0, len(keys))
		for _, k := range keys {
			lines = append(lines, fmt.Sprintf("%s=%q", k, m[k]))
		}
		return strings.Join(lines, "\n")
	}
	if k, ok := strings.CutPrefix(path, "metadata.labels['"); ok {
		return p.Labels[strings.TrimSuffix(k, "']")], nil
	}
	if k, ok := strings.CutPrefix(path, "metadata.annotations['"); ok {
		return p.Annotations[strings.TrimSuffix(k, "']")], nil
	}
	switch path {
	case "metadata.name":
		return p.Name, nil
	case "metadata.namespace":
		return p.Namespace, nil
	case "metadata.uid":
		return string(p.UID), nil
	case "metadata.labels":
		return formatMap(p.Labels), nil
	case "metadata.annotations":
		return formatMap(p.Annotations), nil
	case "spec.nodeName":
		return p.Spec.NodeName, nil
	case "spec.serviceAccountName":
		return p.Spec.ServiceAccountName, nil
	case "status.hostIP", "status.hostIPs":
		return "127.0.0.1", nil
	case "status.podIP", "status.podIPs":
		return w.podIP, nil
	}
	return "", fmt.Errorf("unsupported fieldRef %q", path)
}

func (w *podWorker) resourceValue(spec corev1.Container, ref *corev1.ResourceFieldSelector) string {
	var q = spec.Resources.Limits
	name := strings.TrimPrefix(ref.Resource, "limits.")
	if strings.HasPrefix(ref.Resource, "requests.") {
		q, name = spec.Resources.Requests, strings.TrimPrefix(ref.Resource, "requests.")
	}
	v, ok := q[corev1.ResourceName(name)]
	if !ok {
		// Unset limits default to the node's allocatable, as in the kubelet.
		st := w.a.nodeStatus()
		v = st.Allocatable[corev1.ResourceName(name)]
	}
	div := ref.Divisor
	if div.IsZero() {
		if name == "cpu" {
			return strconv.FormatInt(v.MilliValue()/1000+min(1, v.MilliValue()%1000), 10)
		}
		return strconv.FormatInt(v.Value(), 10)
	}
	return strconv.FormatInt((v.MilliValue()+div.MilliValue()-1)/div.MilliValue(), 10)
}

func (w *podWorker) getSecret(ns, name string) (*corev1.Secret, error) {
	return w.a.client.CoreV1().Secrets(ns).Get(w.a.ctx, name, metav1.GetOptions{})
}

func (w *podWorker) getConfigMap(ns, name string) (*corev1.ConfigMap, error) {
	return w.a.client.CoreV1().ConfigMaps(ns).Get(w.a.ctx, name, metav1.GetOptions{})
}

// buildExec computes argv, environment and working directory for a container.
func (w *podWorker) buildExec(spec corev1.Container) ([]string, []string, string, error) {
	p := w.pod
	c := w.a.c
	type kv struct{ k, v string }
	var vars []kv
	m := map[string]string{}
	set := func(k, v string) {
		if _, ok := m[k]; ok {
			for i := range vars {
				if vars[i].k == k {
					vars[i].v = v
				}
			}
		} else {
			vars = append(vars, kv{k, v})
		}
		m[k] = v
	}
	workDir := filepath.Join(w.dir, "containers", spec.Name)
	set("HOME", workDir)
	set("HOSTNAME", p.Name)
	set("LANG", "C.UTF-8")
	port := strconv.Itoa(c.apiPort)
	set("KUBERNETES_SERVICE_HOST", "127.0.0.1")
	set("KUBERNETES_SERVICE_PORT", port)
	set("KUBERNETES_SERVICE_PORT_HTTPS", port)
	set("KUBERNETES_PORT", "tcp://127.0.0.1:"+port)
	set("LOCALCLUSTER_POD_IP", w.podIP)
	set("LOCALCLUSTER_POD_DIR", w.dir)
	set("LOCALCLUSTER_NODE_NAME", w.a.name)
	for _, vm := range spec.VolumeMounts {
		if d, ok := w.volDirs[vm.Name]; ok {
			if vm.SubPath != "" {
				d = filepath.Join(d, vm.SubPath)
			}
			set("LOCALCLUSTER_VOLUME_"+upperSnake(vm.Name), d)
			if kc, ok := w.kubeconfigs[vm.Name]; ok {
				set("KUBECONFIG", kc)
			}
		}
	}
	optional := func(b *bool) bool { return b != nil && *b }
	for _, ef := range spec.EnvFrom {
		var data map[string]string
		switch {
		case ef.ConfigMapRef != nil:
			cm, err := w.getConfigMap(p.Namespace, ef.ConfigMapRef.Name)
			if err != nil {
				if apierrors.IsNotFound(err) && optional(ef.ConfigMapRef.Optional) {
					continue
				}
				return nil, nil, "", fmt.Errorf("configmap %q: %w", ef.ConfigMapRef.Name, err)
			}
			data = cm.Data
		case ef.SecretRef != nil:
			s, err := w.getSecret(p.Namespace, ef.SecretRef.Name)
			if err != nil {
				if apierrors.IsNotFound(err) && optional(ef.SecretRef.Optional) {
					continue
				}
				return nil, nil, "", fmt.Errorf("secret %q: %w", ef.SecretRef.Name, err)
			}
			data = map[string]string{}
			for k, v := range s.Data {
				data[k] = string(v)
			}
		}
		keys := make([]string, 0, len(data))
		for k := range data {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			set(ef.Prefix+k, w.translate(spec, data[k]))
		}
	}
	for _, e := range spec.Env {
		val := e.Value
		if e.ValueFrom == nil {
			val = expansion.Expand(val, expansion.MappingFuncFor(m))
		} else {
			vf := e.ValueFrom
			switch {
			case vf.FieldRef != nil:
				v, err := w.fieldValue(vf.FieldRef.FieldPath)
				if err != nil {
					return nil, nil, "", fmt.Errorf("env %s: %w", e.Name, err)
				}
				val = v
			case vf.ResourceFieldRef != nil:
				val = w.resourceValue(spec, vf.ResourceFieldRef)
			case vf.SecretKeyRef != nil:
				s, err := w.getSecret(p.Namespace, vf.SecretKeyRef.Name)
				if err != nil {
					if apierrors.IsNotFound(err) && optional(vf.SecretKeyRef.Optional) {
						continue
					}
					return nil, nil, "", fmt.Errorf("env %s: secret %q: %w", e.Name, vf.SecretKeyRef.Name, err)
				}
				b, ok := s.Data[vf.SecretKeyRef.Key]
				if !ok {
					if optional(vf.SecretKeyRef.Optional) {
						continue
					}
					return nil, nil, "", fmt.Errorf("env %s: secret %q has no key %q", e.Name, vf.SecretKeyRef.Name, vf.SecretKeyRef.Key)
				}
				val = string(b)
			case vf.ConfigMapKeyRef != nil:
				cm, err := w.getConfigMap(p.Namespace, vf.ConfigMapKeyRef.Name)
				if err != nil {
					if apierrors.IsNotFound(err) && optional(vf.ConfigMapKeyRef.Optional) {
						continue
					}
					return nil, nil, "", fmt.Errorf("env %s: configmap %q: %w", e.Name, vf.ConfigMapKeyRef.Name, err)
				}
				v, ok := cm.Data[vf.ConfigMapKeyRef.Key]
				if !ok {
					if optional(vf.ConfigMapKeyRef.Optional) {
						continue
					}
					return nil, nil, "", fmt.Errorf("env %s: configmap %q has no key %q", e.Name, vf.ConfigMapKeyRef.Name, vf.ConfigMapKeyRef.Key)
				}
				val = v
			default:
				return nil, nil, "", fmt.Errorf("env %s: unsupported valueFrom", e.Name)
			}
		}
		set(e.Name, w.translate(spec, val))
	}
	// PATH: the project's tools first, then the container's own PATH, then the agent's.
	var path []string
	path = append(path, filepath.SplitList(c.cfg.podPathPrefix)...)
	if v, ok := m["PATH"]; ok {
		path = append(path, filepath.SplitList(v)...)
	}
	path = append(path, filepath.SplitList(os.Getenv("PATH"))...)
	seen := map[string]bool{}
	var dedup []string
	for _, d := range path {
		if d != "" && !seen[d] {
			seen[d] = true
			dedup = append(dedup, d)
		}
	}
	set("PATH", strings.Join(dedup, string(os.PathListSeparator)))

	mapping := expansion.MappingFuncFor(m)
	var argv []string
	for _, a := range spec.Command {
		argv = append(argv, w.translate(spec, expansion.Expand(a, mapping)))
	}
	for _, a := range spec.Args {
		argv = append(argv, w.translate(spec, expansion.Expand(a, mapping)))
	}
	if len(spec.Command) == 0 {
		return nil, nil, "", fmt.Errorf("container %q has no command: localcluster ignores images, so set command (and args)", spec.Name)
	}
	exe, err := lookPath(argv[0], m["PATH"])
	if err != nil {
		return nil, nil, "", err
	}
	argv[0] = exe
	if spec.WorkingDir != "" {
		workDir = w.translate(spec, spec.WorkingDir)
	}
	env := make([]string, 0, len(vars))
	for _, v := range vars {
		env = append(env, v.k+"="+v.v)
	}
	return argv, env, workDir, nil
}

// writeFileMode writes a volume file with exactly the mode the pod asks for (items[].mode,
// else the volume's defaultMode, else 0644), past the umask, as the kubelet's atomic writer
// does; the new content replaces the old by rename.
func writeFileMode(path string, data []byte, mode *int32, def *int32) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	perm := os.FileMode(0o644)
	if def != nil {
		perm = os.FileMode(*def)
	}
	if mode != nil {
		perm = os.FileMode(*mode)
	}
	perm &= os.ModePerm
	tmp := path + ".tmp"
	_ = os.Remove(tmp) // a leftover read-only one could not be opened for writing
	if err := os.WriteFile(tmp, data, perm); err != nil {
		return err
	}
	if err := os.Chmod(tmp, perm); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// Masks the kubelet adds for the pod's fsGroup (SetVolumeOwnership): group read for
// read-only volumes (secret, configMap, downwardAPI, projected), group read-write for
// emptyDir; directories also get setgid and group search.
const (
	fsGroupROMask   = os.FileMode(0o440)
	fsGroupRWMask   = os.FileMode(0o660)
	fsGroupExecMask = os.FileMode(0o110)
)

// applyFSGroup gives every file and directory of a volume the pod's fsGroup as its group and
// the group permissions the kubelet adds. The agent can give a file a group it is not in only
// when it runs as root; otherwise the group stays the agent's own and only the modes apply
// (README, "Limitations").
func applyFSGroup(dir string, gid int64, readOnly bool) error {
	mask := fsGroupRWMask
	if readOnly {
		mask = fsGroupROMask
	}
	chown := os.Geteuid() == 0
	return filepath.Walk(dir, func(path string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if chown {
			if err := os.Lchown(path, -1, int(gid)); err != nil {
				return fmt.Errorf("fsGroup %d on %s: %w", gid, path, err)
			}
		}
		if info.Mode()&os.ModeSymlink != 0 {
			return nil
		}
		m := info.Mode().Perm() | mask
		if info.IsDir() {
			m |= os.ModeSetgid | fsGroupExecMask
		}
		return os.Chmod(path, m)
	})
}

func (w *podWorker) writeKeys(dir string, data map[string][]byte, items []corev1.KeyToPath, def *int32, optional bool, what string) error {
	if items == nil {
		for k, v := range data {
			if err := writeFileMode(filepath.Join(dir, k), v, nil, def); err != nil {
				return err
			}
		}
		return nil
	}
	for _, it := range items {
		v, ok := data[it.Key]
		if !ok {
			if optional {
				continue
			}
			return fmt.Errorf("%s has no key %q", what, it.Key)
		}
		if err := writeFileMode(filepath.Join(dir, it.Path), v, it.Mode, def); err != nil {
			return err
		}
	}
	return nil
}

func (w *podWorker) secretData(name string, optional bool) (map[string][]byte, error) {
	s, err := w.getSecret(w.pod.Namespace, name)
	if err != nil {
		if apierrors.IsNotFound(err) && optional {
			return map[string][]byte{}, nil
		}
		return nil, fmt.Errorf("secret %q: %w", name, err)
	}
	return s.Data, nil
}

func (w *podWorker) configMapData(name string, optional bool) (map[string][]byte, error) {
	cm, err := w.getConfigMap(w.pod.Namespace, name)
	if err != nil {
		if apierrors.IsNotFound(err) && optional {
			return map[string][]byte{}, nil
		}
		return nil, fmt.Errorf("configmap %q: %w", name, err)
	}
	data := map[string][]byte{}
	for k, v := range cm.Data {
		data[k] = []byte(v)
	}
	for k, v := range cm.BinaryData {
		data[k] = v
	}
	return data, nil
}

func (w *podWorker) downward(dir string, items []corev1.DownwardAPIVolumeFile, def *int32, spec corev1.Container) error {
	for _, it := range items {
		var v string
		switch {
		case it.FieldRef != nil:
			s, err := w.fieldValue(it.FieldRef.FieldPath)
			if err != nil {
				return err
			}
			v = s
		case it.ResourceFieldRef != nil:
			v = w.resourceValue(spec, it.ResourceFieldRef)
		}
		if err := writeFileMode(filepath.Join(dir, it.Path), []byte(v), it.Mode, def); err != nil {
			return err
		}
	}
	return nil
}

func (w *podWorker) setup() error {
	if err := os.MkdirAll(filepath.Join(w.dir, "volumes"), 0o755); err != nil {
		return err
	}
	return w.setupVolumes(false)
}

// setupVolumes materialises each volume as a host directory; with tokensOnly it refreshes
// the projected service-account tokens alone.
func (w *podWorker) setupVolumes(tokensOnly bool) error {
	p := w.pod
	optional := func(b *bool) bool { return b != nil && *b }
	var first corev1.Container
	if len(p.Spec.Containers) > 0 {
		first = p.Spec.Containers[0]
	}
	for _, v := range p.Spec.Volumes {
		dir := filepath.Join(w.dir, "volumes", v.Name)
		if !tokensOnly {
			w.volDirs[v.Name] = dir
		}
		vs := v.VolumeSource
		if tokensOnly && vs.Projected == nil {
			continue
		}
		switch {
		case vs.HostPath != nil:
			w.volDirs[v.Name] = vs.HostPath.Path
			if vs.HostPath.Type != nil && *vs.HostPath.Type == corev1.HostPathDirectoryOrCreate {
				if err := os.MkdirAll(vs.HostPath.Path, 0o755); err != nil {
					return err
				}
			}
			continue
		case vs.Secret != nil:
			data, err := w.secretData(vs.Secret.SecretName, optional(vs.Secret.Optional))
			if err != nil {
				return err
			}
			if err := w.writeKeys(dir, data, vs.Secret.Items, vs.Secret.DefaultMode, optional(vs.Secret.Optional), "secret "+vs.Secret.SecretName); err != nil {
				return err
			}
		case vs.ConfigMap != nil:
			data, err := w.configMapData(vs.ConfigMap.Name, optional(vs.ConfigMap.Optional))
			if err != nil {
				return err
			}
			if err := w.writeKeys(dir, data, vs.ConfigMap.Items, vs.ConfigMap.DefaultMode, optional(vs.ConfigMap.Optional), "configmap "+vs.ConfigMap.Name); err != nil {
				return err
			}
		case vs.DownwardAPI != nil:
			if err := w.downward(dir, vs.DownwardAPI.Items, vs.DownwardAPI.DefaultMode, first); err != nil {
				return err
			}
		case vs.Projected != nil:
			if err := w.setupProjected(v.Name, dir, vs.Projected, tokensOnly, first); err != nil {
				return err
			}
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if sc := p.Spec.SecurityContext; sc != nil && sc.FSGroup != nil {
			var err error
			switch {
			case vs.EmptyDir != nil:
				err = applyFSGroup(dir, *sc.FSGroup, false)
			case vs.Secret != nil, vs.ConfigMap != nil, vs.DownwardAPI != nil, vs.Projected != nil:
				err = applyFSGroup(dir, *sc.FSGroup, true)
			}
			if err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *podWorker) setupProjected(name, dir string, proj *corev1.ProjectedVolumeSource, tokensOnly bool, first corev1.Container) error {
	p := w.pod
	optional := func(b *bool) bool { return b != nil && *b }
	for _, src := range proj.Sources {
		switch {
		case src.ServiceAccountToken != nil:
			sat := src.ServiceAccountToken
			exp := int64(3607)
			if sat.ExpirationSeconds != nil {
				exp = *sat.ExpirationSeconds
			}
			var aud []string
			if sat.Audience != "" {
				aud = []string{sat.Audience}
			}
			sa := p.Spec.ServiceAccountName
			if sa == "" {
				sa = "default"
			}
			// Bound to the pod, as the kubelet requests it; the Node authorizer allows
			// exactly this for pods on this node.
			tr, err := w.a.client.CoreV1().ServiceAccounts(p.Namespace).CreateToken(w.a.ctx, sa, &authenticationv1.TokenRequest{
				Spec: authenticationv1.TokenRequestSpec{
					Audiences: aud, ExpirationSeconds: &exp,
					BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: p.Name, UID: p.UID},
				},
			}, metav1.CreateOptions{})
			if err != nil {
				return fmt.Errorf("service account token for %q: %w", sa, err)
			}
			tokenPath := filepath.Join(dir, sat.Path)
			if err := writeFileMode(tokenPath, []byte(tr.Status.Token), nil, proj.DefaultMode); err != nil {
				return err
			}
			ttl := time.Until(tr.Status.ExpirationTimestamp.Time)
			w.tokenAt = time.Now().Add(ttl * 8 / 10)
			if sat.Audience == "" && !tokensOnly {
				// A kubeconfig that logs in as the pod's ServiceAccount, since processes
				// cannot see the in-cluster paths under /var/run/secrets.
				kdir := filepath.Join(w.dir, "kubeconfigs")
				if err := os.MkdirAll(kdir, 0o755); err != nil {
					return err
				}
				kc := filepath.Join(kdir, name+".kubeconfig")
				if err := os.WriteFile(kc, kubeconfig(w.a.c.apiURL, w.a.c.ca.certPEM, nil, nil, tokenPath, p.Namespace), 0o600); err != nil {
					return err
				}
				w.kubeconfigs[name] = kc
			}
		case tokensOnly:
			continue
		case src.ConfigMap != nil:
			data, err := w.configMapData(src.ConfigMap.Name, optional(src.ConfigMap.Optional))
			if err != nil {
				return err
			}
			if err := w.writeKeys(dir, data, src.ConfigMap.Items, proj.DefaultMode, optional(src.ConfigMap.Optional), "configmap "+src.ConfigMap.Name); err != nil {
				return err
			}
		case src.Secret != nil:
			data, err := w.secretData(src.Secret.Name, optional(src.Secret.Optional))
			if err != nil {
				return err
			}
			if err := w.writeKeys(dir, data, src.Secret.Items, proj.DefaultMode, optional(src.Secret.Optional), "secret "+src.Secret.Name); err != nil {
				return err
			}
		case src.DownwardAPI != nil:
			if err := w.downward(dir, src.DownwardAPI.Items, proj.DefaultMode, first); err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *podWorker) condition(t corev1.PodConditionType, ok bool, reason, msg string) corev1.PodCondition {
	s := corev1.ConditionFalse
	if ok {
		s = corev1.ConditionTrue
	}
	prev, seen := w.transitions[t]
	if !seen || prev.status != s {
		prev = condState{status: s, at: metav1.Now()}
		w.transitions[t] = prev
	}
	return corev1.PodCondition{Type: t, Status: s, Reason: reason, Message: msg, LastTransitionTime: prev.at}
}

func (w *podWorker) containerStatus(cr *containerRun) corev1.ContainerStatus {
	cs := corev1.ContainerStatus{
		Name: cr.spec.Name, Image: cr.spec.Image, ImageID: "", ContainerID: cr.containerID,
		Ready: cr.running && cr.ready, RestartCount: cr.restarts, Started: ptr.To(cr.running),
	}
	if cs.Image == "" {
		cs.Image = "none"
	}
	switch {
	case cr.running:
		cs.State.Running = &corev1.ContainerStateRunning{StartedAt: metav1.NewTime(cr.startedAt)}
	case cr.term != nil && (w.finished || w.terminating || !w.shouldRestartAny(cr)):
		cs.State.Terminated = cr.term.DeepCopy()
	case cr.term != nil:
		cs.State.Waiting = &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff",
			Message: fmt.Sprintf("back-off restarting failed container %s", cr.spec.Name)}
		cs.LastTerminationState.Terminated = cr.term.DeepCopy()
	case cr.waitReason != "":
		cs.State.Waiting = &corev1.ContainerStateWaiting{Reason: cr.waitReason, Message: cr.waitMessage}
	default:
		reason := "ContainerCreating"
		if cr.kind == kindMain && !w.initialized {
			reason = "PodInitializing"
		}
		cs.State.Waiting = &corev1.ContainerStateWaiting{Reason: reason}
	}
	if cs.LastTerminationState.Terminated == nil && cr.lastTerm != nil {
		cs.LastTerminationState.Terminated = cr.lastTerm.DeepCopy()
	}
	return cs
}

func (w *podWorker) shouldRestartAny(cr *containerRun) bool {
	switch cr.kind {
	case kindSidecar:
		return true
	case kindInit:
		return cr.term.ExitCode != 0 && w.restartPolicy() != corev1.RestartPolicyNever
	}
	return w.shouldRestart(cr)
}

func (w *podWorker) pushStatus() {
	if w.a.dead.Load() {
		return
	}
	p := w.pod
	st := map[string]any{}
	var initStatuses, mainStatuses []corev1.ContainerStatus
	allReady, anyRunning, anyStarted := true, false, false
	for _, cr := range w.ctrs {
		cs := w.containerStatus(cr)
		if cr.kind == kindMain {
			mainStatuses = append(mainStatuses, cs)
			if !cs.Ready {
				allReady = false
			}
			anyRunning = anyRunning || cr.running
			anyStarted = anyStarted || cr.everStarted
		} else {
			initStatuses = append(initStatuses, cs)
			if cr.kind == kindSidecar && !cs.Ready {
				allReady = false
			}
		}
	}
	phase := corev1.PodPending
	switch {
	case w.finished:
		phase = w.finalPhase
	case w.initialized && anyStarted:
		phase = corev1.PodRunning
	}
	gatesOK := true
	for _, g := range p.Spec.ReadinessGates {
		found := false
		for _, c := range p.Status.Conditions {
			if c.Type == g.ConditionType && c.Status == corev1.ConditionTrue {
				found = true
			}
		}
		gatesOK = gatesOK && found
	}
	readyReason := ""
	if w.finished {
		allReady, readyReason = false, "PodCompleted"
	} else if !allReady {
		readyReason = "ContainersNotReady"
	}
	initReason := ""
	if !w.initialized && !w.finished {
		initReason = "ContainersNotInitialized"
	}
	conds := []corev1.PodCondition{
		w.condition(corev1.PodReadyToStartContainers, w.setupDone && !(w.finished && !anyRunning && w.terminating), "", ""),
		w.condition(corev1.PodInitialized, w.initialized || (w.finished && len(initStatuses) == 0), initReason, ""),
		w.condition(corev1.ContainersReady, allReady, readyReason, ""),
		w.condition(corev1.PodReady, allReady && gatesOK, readyReason, ""),
	}
	if w.setupErr != nil {
		conds[0].Message = w.setupErr.Error()
	}
	if w.shutdownMode {
		conds = append(conds, w.condition(corev1.DisruptionTarget, true, corev1.PodReasonTerminationByKubelet,
			"Pod was terminated in response to imminent node shutdown."))
	}
	// Strategic merge keeps fields a patch omits, so stale reasons and messages are cleared
	// with explicit nulls.
	condPatch := make([]map[string]any, 0, len(conds))
	for _, c := range conds {
		m := map[string]any{"type": c.Type, "status": c.Status, "lastTransitionTime": c.LastTransitionTime, "reason": nil, "message": nil}
		if c.Reason != "" {
			m["reason"] = c.Reason
		}
		if c.Message != "" {
			m["message"] = c.Message
		}
		condPatch = append(condPatch, m)
	}
	st["phase"] = phase
	st["conditions"] = condPatch
	st["reason"], st["message"] = nil, nil
	st["podIP"] = w.podIP
	st["podIPs"] = []corev1.PodIP{{IP: w.podIP}}
	st["hostIP"] = "127.0.0.1"
	st["hostIPs"] = []corev1.HostIP{{IP: "127.0.0.1"}}
	st["startTime"] = w.start
	st["containerStatuses"] = mainStatuses
	st["initContainerStatuses"] = initStatuses
	if w.shutdownMode && w.finished {
		st["reason"] = "Terminated"
		st["message"] = "Pod was terminated in response to imminent node shutdown."
	}
	if w.setupErr != nil {
		st["message"] = w.setupErr.Error()
	}
	body, err := json.Marshal(map[string]any{"status": st})
	if err != nil {
		w.logf("status: %v", err)
		return
	}
	if bytes.Equal(body, w.lastPushed) {
		return
	}
	_, err = w.a.client.CoreV1().Pods(p.Namespace).Patch(w.a.ctx, p.Name, types.StrategicMergePatchType, body, metav1.PatchOptions{}, "status")
	if err != nil {
		if !apierrors.IsNotFound(err) && w.a.ctx.Err() == nil {
			w.logf("status patch: %v", err)
		}
		return
	}
	w.lastPushed = body
}
