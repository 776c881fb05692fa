package main

// Readiness probes (httpGet against the pod IP, tcpSocket, exec), as the kubelet runs them.

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

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
		if w.a.frozen.Load() {
			// freeze-node: the container is stopped and the node cut off; no verdict counts.
			okRun, failRun = 0, 0
			select {
			case <-ctx.Done():
				return
			case <-time.After(period):
			}
			continue
		}
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
