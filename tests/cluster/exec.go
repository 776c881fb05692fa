package main

// Starting a container as a local process group: command, args, environment and working
// directory as the kubelet would build them, with paths under volume mounts translated to the
// volumes' host directories (processes cannot see mounts).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/kubernetes/third_party/forked/golang/expansion"
)

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
	// Each run of the container starts with an empty termination message file, as with the
	// kubelet's per-container file.
	termLog := w.terminationLog(cr.spec)
	if err := os.MkdirAll(filepath.Dir(termLog), 0o755); err == nil {
		_ = os.WriteFile(termLog, nil, 0o666)
		_ = os.Chmod(termLog, 0o666)
	}
	newCmd := func(argv []string, unshare uintptr) *exec.Cmd {
		cmd := exec.Command(argv[0], argv[1:]...)
		cmd.Env, cmd.Dir, cmd.Stdout, cmd.Stderr = env, workDir, logFile, logFile
		// Own process group, so signals reach the whole container; Pdeathsig kills it if the
		// agent's process dies abruptly.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL, Unshareflags: unshare}
		return cmd
	}
	cr.logPaths = append(cr.logPaths, logPath)
	cr.everStarted = true
	now := time.Now()
	// The container's own /etc/resolv.conf, /etc/hosts and hostname (podnet.go), unless this
	// machine refuses the namespaces: then it starts as a plain process and its log says so.
	var cmd *exec.Cmd
	if !w.a.c.noPodNamespaces.Load() {
		var initArgv []string
		if initArgv, err = w.containerInitArgs(argv); err == nil {
			cmd = newCmd(initArgv, containerUnshare)
			err = cmd.Start()
		}
		if err != nil {
			if errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EINVAL) {
				w.a.c.noPodNamespaces.Store(true)
			}
			fmt.Fprintf(logFile, "localcluster: cannot give the container its own /etc/resolv.conf, /etc/hosts and hostname (%v); it sees the host's\n", err)
			cmd = nil
		}
	} else {
		fmt.Fprintf(logFile, "localcluster: this machine refused containers their own mount and UTS namespaces; the container sees the host's /etc/resolv.conf, /etc/hosts and hostname\n")
	}
	if cmd == nil {
		cmd = newCmd(argv, 0)
		err = cmd.Start()
	}
	if err != nil {
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
			ContainerID: cr.containerID, Message: readTerminationMessage(termLog),
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
	if v == terminationMessagePath(spec) {
		// The kubelet bind-mounts a file of its own there; the agent cannot (its containers
		// may share the host's /dev), so the path stands for that file where the container
		// names it, in its env or args, as a volume's mount path does.
		return w.terminationLog(spec)
	}
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

// terminationMessagePath is where the container writes its termination message.
func terminationMessagePath(spec corev1.Container) string {
	if spec.TerminationMessagePath != "" {
		return spec.TerminationMessagePath
	}
	return corev1.TerminationMessagePathDefault
}

// terminationLog is the host file that stands for the container's terminationMessagePath.
func (w *podWorker) terminationLog(spec corev1.Container) string {
	return filepath.Join(w.dir, "termination", spec.Name)
}

// maxTerminationMessage is the kubelet's limit on one container's termination message.
const maxTerminationMessage = 4096

// readTerminationMessage is what the kubelet puts in state.terminated.message: the first
// 4096 bytes of the file (FallbackToLogsOnError's log tail is not reproduced).
func readTerminationMessage(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	buf := make([]byte, maxTerminationMessage)
	n, _ := io.ReadFull(f, buf)
	return string(buf[:n])
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
	set("HOSTNAME", podHostname(p))
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
