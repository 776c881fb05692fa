package main

// The pod's status as the kubelet reports it: phase, conditions, container statuses.

import (
	"bytes"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

type condState struct {
	status corev1.ConditionStatus
	at     metav1.Time
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
