package main

// A node agent: a small kubelet that registers a Node, renews its Lease, serves the kubelet's
// containerLogs endpoint, and runs each pod bound to the node as local processes (pod.go).

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
)

const (
	leaseRenewInterval = 2 * time.Second
	nodeStatusInterval = 10 * time.Second
	// The kubelet renews its Lease every quarter of its duration (nodeLeaseDurationSeconds,
	// 40 s: every 10 s); this agent renews every 2 s, so its Lease says 8 s, and whoever
	// reads the renew interval from the Lease (the operator's node-loss window) reads 2 s.
	leaseDurationSecond = int32(4 * leaseRenewInterval / time.Second)
	kubeletVersion      = "v1.37.2"
)

type agent struct {
	c        *cluster
	name     string
	spot     bool
	client   *kubernetes.Clientset
	ctx      context.Context
	cancel   context.CancelFunc
	port     int
	listener net.Listener
	mu       sync.Mutex
	workers  map[types.UID]*podWorker
	dead     atomic.Bool
	shutdown atomic.Bool // graceful node shutdown in progress (no new pods start)
	// frozen: freeze-node holds the node cut off (no Lease, no status, pod workers and probes
	// idle, processes stopped). Changed only under hbMu.
	frozen atomic.Bool
	// hbMu is held around each Lease renewal and node status post, so a freeze waits out one
	// already in flight and nothing reaches the API server once freeze returns.
	hbMu    sync.Mutex
	nodeUID types.UID
	logf    func(string, ...any)
}

func newAgent(c *cluster, name string, spot bool) (*agent, error) {
	// The agent authenticates as system:node:<name> in group system:nodes, so the Node
	// authorizer and NodeRestriction admission confine it as they confine a kubelet.
	kc, err := c.writeClientKubeconfig("node-"+name, "system:node:"+name, []string{"system:nodes"})
	if err != nil {
		return nil, err
	}
	restCfg, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		return nil, err
	}
	restCfg.QPS, restCfg.Burst = 50, 100
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return nil, err
	}
	l, err := c.kubeletListener(name)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(c.ctx)
	a := &agent{
		c: c, name: name, spot: spot, client: client, ctx: ctx, cancel: cancel,
		port: l.Addr().(*net.TCPAddr).Port, listener: l, workers: map[types.UID]*podWorker{},
	}
	a.logf = func(format string, args ...any) { c.logf("[%s] %s", name, fmt.Sprintf(format, args...)) }
	return a, nil
}

// kubeletListener opens the TLS listener for the kubelet API (containerLogs).
func (c *cluster) kubeletListener(name string) (net.Listener, error) {
	cert, key, err := c.ca.issue("system:node:"+name, []string{"system:nodes"}, []net.IP{net.ParseIP("127.0.0.1")}, []string{name, "localhost"}, true)
	if err != nil {
		return nil, err
	}
	pair, err := tls.X509KeyPair(cert, key)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AddCert(c.ca.cert)
	// Only the API server (or another holder of a cluster-CA client certificate) may read logs.
	return tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{pair}, ClientCAs: pool,
		ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12,
	})
}

func (a *agent) labels() map[string]string {
	l := map[string]string{
		"kubernetes.io/hostname":           a.name,
		"kubernetes.io/os":                 runtime.GOOS,
		"kubernetes.io/arch":               runtime.GOARCH,
		"node.kubernetes.io/instance-type": "localcluster",
		"topology.kubernetes.io/region":    "local",
		"topology.kubernetes.io/zone":      "local-a",
	}
	if a.spot {
		// The capacity-type labels the common provisioners put on spot capacity.
		l["node.kubernetes.io/lifecycle"] = "spot"
		l["karpenter.sh/capacity-type"] = "spot"
		l["eks.amazonaws.com/capacityType"] = "SPOT"
		l["cloud.google.com/gke-spot"] = "true"
	} else {
		l["node.kubernetes.io/lifecycle"] = "on-demand"
		l["karpenter.sh/capacity-type"] = "on-demand"
	}
	return l
}

func (a *agent) nodeStatus() corev1.NodeStatus {
	res := corev1.ResourceList{
		corev1.ResourceCPU:              resource.MustParse(a.c.cfg.cpu),
		corev1.ResourceMemory:           resource.MustParse(a.c.cfg.memory),
		corev1.ResourcePods:             resource.MustParse("110"),
		corev1.ResourceEphemeralStorage: resource.MustParse("100Gi"),
	}
	if a.c.cfg.gpusPerNode > 0 {
		res["nvidia.com/gpu"] = *resource.NewQuantity(int64(a.c.cfg.gpusPerNode), resource.DecimalSI)
	}
	now := metav1.Now()
	cond := func(t corev1.NodeConditionType, s corev1.ConditionStatus, reason, msg string) corev1.NodeCondition {
		return corev1.NodeCondition{Type: t, Status: s, Reason: reason, Message: msg, LastHeartbeatTime: now, LastTransitionTime: now}
	}
	return corev1.NodeStatus{
		Capacity:    res,
		Allocatable: res.DeepCopy(),
		Conditions: []corev1.NodeCondition{
			cond(corev1.NodeMemoryPressure, corev1.ConditionFalse, "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
			cond(corev1.NodeDiskPressure, corev1.ConditionFalse, "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
			cond(corev1.NodePIDPressure, corev1.ConditionFalse, "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
			cond(corev1.NodeReady, corev1.ConditionTrue, "KubeletReady", "localcluster node agent is posting ready status"),
		},
		Addresses: []corev1.NodeAddress{
			{Type: corev1.NodeInternalIP, Address: "127.0.0.1"},
			{Type: corev1.NodeHostName, Address: a.name},
		},
		DaemonEndpoints: corev1.NodeDaemonEndpoints{KubeletEndpoint: corev1.DaemonEndpoint{Port: int32(a.port)}},
		NodeInfo: corev1.NodeSystemInfo{
			MachineID: a.name, SystemUUID: a.name, BootID: strconv.FormatInt(time.Now().UnixNano(), 10),
			KernelVersion: "localcluster", OSImage: "localcluster (processes on the host)",
			ContainerRuntimeVersion: "localcluster://" + kubeletVersion, KubeletVersion: kubeletVersion,
			OperatingSystem: runtime.GOOS, Architecture: runtime.GOARCH,
		},
	}
}

func (a *agent) register() error {
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: a.name, Labels: a.labels()},
	}
	created, err := a.client.CoreV1().Nodes().Create(a.ctx, node, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		created, err = a.client.CoreV1().Nodes().Get(a.ctx, a.name, metav1.GetOptions{})
	}
	if err != nil {
		return fmt.Errorf("register node %s: %w", a.name, err)
	}
	a.nodeUID = created.UID
	created.Status = a.nodeStatus()
	if _, err := a.client.CoreV1().Nodes().UpdateStatus(a.ctx, created, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("node %s status: %w", a.name, err)
	}
	return nil
}

func (a *agent) run() {
	go a.serveKubeletAPI()
	for {
		err := a.register()
		if err == nil {
			break
		}
		if a.ctx.Err() != nil {
			return
		}
		a.logf("%v (retrying)", err)
		time.Sleep(time.Second)
	}
	go a.leaseLoop()
	go a.statusLoop()
	factory := informers.NewSharedInformerFactoryWithOptions(a.client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", a.name).String()
		}))
	inf := factory.Core().V1().Pods().Informer()
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { a.onPod(obj, false) },
		UpdateFunc: func(_, obj any) { a.onPod(obj, false) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			a.onPod(obj, true)
		},
	})
	factory.Start(a.ctx.Done())
	a.logf("registered (kubelet API on 127.0.0.1:%d, spot=%v)", a.port, a.spot)
	<-a.ctx.Done()
	factory.Shutdown()
}

func (a *agent) onPod(obj any, deleted bool) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	a.mu.Lock()
	if a.dead.Load() {
		a.mu.Unlock()
		return
	}
	w, exists := a.workers[pod.UID]
	if !exists && !deleted {
		if pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
			// A terminal pod from an earlier life of this node name; nothing to run, but it
			// still needs its final deletion if it is being deleted.
			if pod.DeletionTimestamp == nil {
				a.mu.Unlock()
				return
			}
		}
		w = newPodWorker(a, pod)
		a.workers[pod.UID] = w
		go w.run()
	}
	a.mu.Unlock()
	if w == nil {
		return
	}
	if deleted {
		w.removedFromAPI()
	} else {
		w.update(pod)
	}
}

func (a *agent) forget(uid types.UID) {
	a.mu.Lock()
	delete(a.workers, uid)
	a.mu.Unlock()
}

func (a *agent) leaseLoop() {
	t := time.NewTicker(leaseRenewInterval)
	defer t.Stop()
	for {
		a.renewLease()
		select {
		case <-a.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// renewLease renews (or creates) the node's Lease once, unless the node is frozen or dead.
func (a *agent) renewLease() {
	a.hbMu.Lock()
	defer a.hbMu.Unlock()
	if a.frozen.Load() || a.dead.Load() || a.ctx.Err() != nil {
		return
	}
	leases := a.client.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	now := metav1.NewMicroTime(time.Now())
	lease, err := leases.Get(a.ctx, a.name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		lease = &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{
				Name: a.name, Namespace: corev1.NamespaceNodeLease,
				// Owned by the Node, as the kubelet does, so deleting the Node collects it.
				OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: a.name, UID: a.nodeUID}},
			},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(a.name), LeaseDurationSeconds: ptr.To(leaseDurationSecond), RenewTime: &now},
		}
		_, err = leases.Create(a.ctx, lease, metav1.CreateOptions{})
	case err == nil:
		lease.Spec.RenewTime = &now
		lease.Spec.HolderIdentity = ptr.To(a.name)
		lease.Spec.LeaseDurationSeconds = ptr.To(leaseDurationSecond)
		_, err = leases.Update(a.ctx, lease, metav1.UpdateOptions{})
	}
	if err != nil && a.ctx.Err() == nil && !apierrors.IsConflict(err) {
		a.logf("lease: %v", err)
	}
}

func (a *agent) statusLoop() {
	t := time.NewTicker(nodeStatusInterval)
	defer t.Stop()
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-t.C:
		}
		a.postStatus()
	}
}

// postStatus posts the node's status once, unless the node is frozen or dead.
func (a *agent) postStatus() {
	a.hbMu.Lock()
	defer a.hbMu.Unlock()
	if a.frozen.Load() || a.dead.Load() || a.ctx.Err() != nil {
		return
	}
	node, err := a.client.CoreV1().Nodes().Get(a.ctx, a.name, metav1.GetOptions{})
	if err != nil {
		return
	}
	// Keep transition times of unchanged conditions, as the kubelet does.
	fresh := a.nodeStatus()
	for i := range fresh.Conditions {
		for _, old := range node.Status.Conditions {
			if old.Type == fresh.Conditions[i].Type && old.Status == fresh.Conditions[i].Status {
				fresh.Conditions[i].LastTransitionTime = old.LastTransitionTime
			}
		}
	}
	fresh.NodeInfo.BootID = node.Status.NodeInfo.BootID
	node.Status = fresh
	if _, err := a.client.CoreV1().Nodes().UpdateStatus(a.ctx, node, metav1.UpdateOptions{}); err != nil && a.ctx.Err() == nil && !apierrors.IsConflict(err) {
		a.logf("node status: %v", err)
	}
}

// killAll is the abrupt end of the machine: heartbeat stops and every process gets SIGKILL
// (after sigtermFirst, if non-zero, of SIGTERM, for a clean `up` shutdown). No API writes follow.
func (a *agent) killAll(sigtermFirst time.Duration) {
	// Snapshot the workers before cancelling: a cancelled worker removes itself from the map,
	// and its processes must still be killed. onPod checks dead under the same lock, so no
	// worker is added after the snapshot.
	a.mu.Lock()
	a.dead.Store(true)
	workers := make([]*podWorker, 0, len(a.workers))
	for _, w := range a.workers {
		workers = append(workers, w)
	}
	a.mu.Unlock()
	a.cancel()
	if sigtermFirst > 0 {
		for _, w := range workers {
			w.signalAll(sigterm)
			if a.frozen.Load() {
				// A stopped process acts on SIGTERM only once it runs again.
				w.signalAll(sigcont)
			}
		}
		deadline := time.Now().Add(sigtermFirst)
		for time.Now().Before(deadline) {
			alive := false
			for _, w := range workers {
				if w.anyRunning() {
					alive = true
				}
			}
			if !alive {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	for _, w := range workers {
		w.signalAll(sigkill)
	}
	for _, w := range workers {
		w.waitAllExited(5 * time.Second)
		w.dropMemoryVolumes()
	}
	_ = a.listener.Close()
}

// gracefulShutdown terminates every pod within grace, as the kubelet's graceful node shutdown
// does when the machine is told to power off; pods end Failed and stay in the API.
func (a *agent) gracefulShutdown(grace time.Duration) {
	a.shutdown.Store(true)
	a.mu.Lock()
	workers := make([]*podWorker, 0, len(a.workers))
	for _, w := range a.workers {
		workers = append(workers, w)
	}
	a.mu.Unlock()
	for _, w := range workers {
		w.nodeShutdown(grace)
	}
}

func (a *agent) workerFor(ns, name string) *podWorker {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, w := range a.workers {
		p := w.currentPod()
		if p.Namespace == ns && p.Name == name {
			return w
		}
	}
	return nil
}

// serveKubeletAPI serves GET /containerLogs/{ns}/{pod}/{container}, which `kubectl logs`
// reaches through the API server's node proxy.
func (a *agent) serveKubeletAPI() {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	mux.HandleFunc("/containerLogs/", func(w http.ResponseWriter, r *http.Request) {
		parts := strings.Split(strings.TrimPrefix(r.URL.Path, "/containerLogs/"), "/")
		if len(parts) != 3 {
			http.Error(w, "want /containerLogs/{namespace}/{pod}/{container}", http.StatusBadRequest)
			return
		}
		pw := a.workerFor(parts[0], parts[1])
		if pw == nil {
			http.Error(w, fmt.Sprintf("pod %s/%s is not on node %s", parts[0], parts[1], a.name), http.StatusNotFound)
			return
		}
		q := r.URL.Query()
		path, ok := pw.logPath(parts[2], q.Get("previous") == "true")
		if !ok {
			http.Error(w, fmt.Sprintf("container %q in pod %s/%s has no logs (yet)", parts[2], parts[0], parts[1]), http.StatusNotFound)
			return
		}
		tail := -1
		if v := q.Get("tailLines"); v != "" {
			tail, _ = strconv.Atoi(v)
		}
		serveLogFile(r.Context(), w, path, tail, q.Get("follow") == "true", func() bool { return pw.containerRunning(parts[2]) })
	})
	a.c.httpServe(a.listener, mux)
}

func serveLogFile(ctx context.Context, w http.ResponseWriter, path string, tail int, follow bool, running func() bool) {
	f, err := os.Open(path)
	if err != nil {
		http.Error(w, err.Error(), http.StatusNotFound)
		return
	}
	defer f.Close()
	w.Header().Set("Content-Type", "text/plain")
	if tail >= 0 {
		var lines []string
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
		for sc.Scan() {
			lines = append(lines, sc.Text())
			if len(lines) > tail {
				lines = lines[1:]
			}
		}
		for _, l := range lines {
			_, _ = io.WriteString(w, l+"\n")
		}
	} else if _, err := io.Copy(w, f); err != nil {
		return
	}
	if !follow {
		return
	}
	flusher, _ := w.(http.Flusher)
	buf := make([]byte, 32*1024)
	for {
		n, _ := f.Read(buf)
		if n > 0 {
			if _, err := w.Write(buf[:n]); err != nil {
				return
			}
			if flusher != nil {
				flusher.Flush()
			}
			continue
		}
		if !running() {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func podDirName(p *corev1.Pod) string {
	return filepath.Join("pods", fmt.Sprintf("%s_%s_%s", p.Namespace, p.Name, p.UID))
}
