package main

// `localcluster up`: the control plane as child processes of this binary, node agents as
// goroutines of this process, and a control socket for fault injection.

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

func encodeBase64(b []byte) string { return base64.StdEncoding.EncodeToString(b) }

// upConfig is what `localcluster up` was asked for.
type upConfig struct {
	nodes            int
	dir              string
	gpusPerNode      int
	spotNodes        int
	cpu              string
	memory           string
	podPathPrefix    string
	tolerationSecs   int
	nodeMonitorGrace time.Duration
}

type child struct {
	name string
	args []string
	cmd  *exec.Cmd
	done chan struct{}
	// stopping marks an exit this process asked for (stop-apiserver), which must not stop
	// the cluster as an unexpected exit does.
	stopping atomic.Bool
}

// cluster is the running `up` process's state.
type cluster struct {
	cfg         upConfig
	dir         string
	apiURL      string
	apiPort     int
	ca          *certAuthority
	admin       *kubernetes.Clientset
	children    []*child
	mu          sync.Mutex
	agents      map[string]*agent
	nextNode    int
	ipMu        sync.Mutex
	nextIP      int
	ctx         context.Context
	cancel      context.CancelFunc
	logf        func(format string, args ...any)
	shutdownMu  sync.Mutex
	controlSock string
	ipBlock     int
	ipLock      *os.File
	// apiMu serialises stop-apiserver and start-apiserver; apiDown is true in between.
	apiMu   sync.Mutex
	apiDown bool
	// dns is the cluster DNS (dns.go), nil if its address could not be bound.
	dns *clusterDNS
	// noPodNamespaces is set once starting a container in its own namespaces failed.
	noPodNamespaces atomic.Bool
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func mustFreePort() int {
	p, err := freePort()
	if err != nil {
		panic(err)
	}
	return p
}

// allocatePodIP hands out distinct loopback addresses 127.B.x.y from this cluster's block B
// (B >= 1, so a pod IP is never 127.0.0.1). Linux routes all of 127/8 to the loopback device,
// so processes can bind them.
func (c *cluster) allocatePodIP() string {
	c.ipMu.Lock()
	defer c.ipMu.Unlock()
	n := c.nextIP
	c.nextIP++
	x := (n / 254) % 254
	y := 1 + n%254
	return fmt.Sprintf("127.%d.%d.%d", c.ipBlock, x, y)
}

// claimIPBlock picks a /16 of 127/8 that no other cluster on this machine uses. Loopback
// addresses are machine-wide, so two clusters handing out the same pod IP would collide on
// ports; an flock held for the life of this process reserves the block.
func (c *cluster) claimIPBlock() error {
	start := int(time.Now().UnixNano() % 254)
	for i := 0; i < 254; i++ {
		b := 1 + (start+i)%254
		path := filepath.Join(os.TempDir(), fmt.Sprintf("localcluster-ipblock-%d.lock", b))
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o666)
		if err != nil {
			return err
		}
		if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
			f.Close()
			continue
		}
		c.ipBlock, c.ipLock = b, f // kept open: closing would release the lock
		return nil
	}
	return errors.New("all 254 pod IP blocks of 127/8 are in use by other localclusters")
}

func (c *cluster) startChild(name string, args ...string) (*child, error) {
	ch, err := c.launch(name, args)
	if err != nil {
		return nil, err
	}
	c.children = append(c.children, ch)
	return ch, nil
}

// launch starts one component (this binary re-executed) with its log appended to
// DIR/logs/<name>.log.
func (c *cluster) launch(name string, args []string) (*child, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	logFile, err := os.OpenFile(filepath.Join(c.dir, "logs", name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, args...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.Env = os.Environ()
	// Own process group, so a terminal's Ctrl-C reaches only `up`, which stops children in
	// order; Pdeathsig kills the child if `up` itself dies abruptly.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	ch := &child{name: name, args: args, cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		logFile.Close()
		close(ch.done)
		if ch.stopping.Load() {
			return
		}
		select {
		case <-c.ctx.Done():
		default:
			c.logf("component %s exited unexpectedly (%v); see %s", name, cmd.ProcessState, filepath.Join(c.dir, "logs", name+".log"))
			c.cancel()
		}
	}()
	return ch, nil
}

// stopChild sends SIGTERM to a component's process group and waits for it to exit, with
// SIGKILL after `patience`.
func stopChild(ch *child, patience time.Duration) {
	_ = syscall.Kill(-ch.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-ch.done:
	case <-time.After(patience):
		_ = syscall.Kill(-ch.cmd.Process.Pid, syscall.SIGKILL)
		<-ch.done
	}
}

// childIndex is the position of the named component in start order (-1 if none).
func (c *cluster) childIndex(name string) int {
	for i, ch := range c.children {
		if ch.name == name {
			return i
		}
	}
	return -1
}

// stopAPIServer stops kube-apiserver as a restart of its machine or static pod does: SIGTERM,
// its graceful shutdown (in-flight requests finish, watches end), then the port refuses
// connections. etcd, the other components and the node agents keep running and retry.
func (c *cluster) stopAPIServer() (time.Duration, error) {
	c.apiMu.Lock()
	defer c.apiMu.Unlock()
	c.shutdownMu.Lock()
	defer c.shutdownMu.Unlock()
	if c.ctx.Err() != nil {
		return 0, errors.New("the cluster is stopping")
	}
	if c.apiDown {
		return 0, errors.New("kube-apiserver is already stopped: run start-apiserver")
	}
	i := c.childIndex("kube-apiserver")
	if i < 0 {
		return 0, errors.New("no kube-apiserver in this cluster")
	}
	began := time.Now()
	ch := c.children[i]
	ch.stopping.Store(true)
	_ = syscall.Kill(-ch.cmd.Process.Pid, syscall.SIGTERM)
	// Its graceful shutdown closes the listener at once, then can hang in teardown for a
	// minute; a kubelet would SIGKILL it after its grace period, and so does this, sooner.
	addr := fmt.Sprintf("127.0.0.1:%d", c.apiPort)
	closed := time.Now().Add(30 * time.Second)
	for time.Now().Before(closed) {
		conn, err := net.DialTimeout("tcp", addr, 500*time.Millisecond)
		if err != nil {
			break
		}
		conn.Close()
		time.Sleep(100 * time.Millisecond)
	}
	stopChild(ch, 5*time.Second)
	c.apiDown = true
	took := time.Since(began)
	c.logf("kube-apiserver stopped after %.1fs (etcd and its data kept); start-apiserver brings it back", took.Seconds())
	return took, nil
}

// startAPIServer starts kube-apiserver again with the same flags (same port, certificates,
// keys and etcd) and waits until it is ready.
func (c *cluster) startAPIServer() (time.Duration, error) {
	c.apiMu.Lock()
	defer c.apiMu.Unlock()
	began := time.Now()
	err := func() error {
		c.shutdownMu.Lock()
		defer c.shutdownMu.Unlock()
		if c.ctx.Err() != nil {
			return errors.New("the cluster is stopping")
		}
		if !c.apiDown {
			return errors.New("kube-apiserver is running: run stop-apiserver first")
		}
		i := c.childIndex("kube-apiserver")
		ch, err := c.launch("kube-apiserver", c.children[i].args)
		if err != nil {
			return err
		}
		c.children[i] = ch
		c.apiDown = false
		return nil
	}()
	if err != nil {
		return 0, err
	}
	if err := c.waitAPIReady(120 * time.Second); err != nil {
		return 0, err
	}
	took := time.Since(began)
	c.logf("kube-apiserver started again, ready after %.1fs", took.Seconds())
	return took, nil
}

func waitTCP(ctx context.Context, addr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		conn, err := net.DialTimeout("tcp", addr, 500*time.Millisecond)
		if err == nil {
			conn.Close()
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("%s did not accept connections within %s", addr, timeout)
}

func (c *cluster) writeFile(name string, data []byte, mode os.FileMode) (string, error) {
	p := filepath.Join(c.dir, name)
	return p, os.WriteFile(p, data, mode)
}

// writeClientKubeconfig issues a client certificate for user/groups and writes a kubeconfig.
func (c *cluster) writeClientKubeconfig(name, user string, groups []string) (string, error) {
	cert, key, err := c.ca.issue(user, groups, nil, nil, false)
	if err != nil {
		return "", err
	}
	return c.writeFile(filepath.Join("pki", name+".kubeconfig"), kubeconfig(c.apiURL, c.ca.certPEM, cert, key, "", ""), 0o600)
}

func runUp(cfg upConfig) int {
	logf := func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, "%s localcluster: %s\n", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
	}
	if err := up(cfg, logf); err != nil {
		logf("error: %v", err)
		return 1
	}
	return 0
}

func up(cfg upConfig, logf func(string, ...any)) error {
	start := time.Now()
	dir, err := filepath.Abs(cfg.dir)
	if err != nil {
		return err
	}
	for _, sub := range []string{"pki", "logs", "etcd", "pods"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o755); err != nil {
			return err
		}
	}
	_ = os.Remove(filepath.Join(dir, "ready"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := &cluster{cfg: cfg, dir: dir, ctx: ctx, cancel: cancel, logf: logf, agents: map[string]*agent{}}
	c.apiPort = mustFreePort()
	c.apiURL = fmt.Sprintf("https://127.0.0.1:%d", c.apiPort)
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		select {
		case s := <-sigs:
			logf("received %v, stopping", s)
			cancel()
		case <-ctx.Done():
		}
	}()
	defer c.shutdown()
	if err := c.claimIPBlock(); err != nil {
		return err
	}
	if c.dns, err = listenDNS(c.ipBlock, logf); err != nil {
		logf("cluster DNS: %v; pods get the host's resolv.conf (dnsPolicy Default)", err)
		c.dns = nil
	}
	if err := c.startControlPlane(); err != nil {
		return err
	}
	if c.dns != nil {
		if err := c.dns.serve(ctx, c.admin); err != nil {
			return err
		}
		logf("cluster DNS for %s on %s:53 (udp, tcp); other names go to %v", c.dns.domain, c.dns.ip, c.dns.upstream)
	}
	logf("control plane up after %.1fs", time.Since(start).Seconds())
	for i := 0; i < cfg.nodes; i++ {
		if _, err := c.addNode(i < cfg.spotNodes); err != nil {
			return err
		}
	}
	if err := c.serveControl(); err != nil {
		return err
	}
	if err := c.waitNodesReady(); err != nil {
		return err
	}
	if _, err := c.writeFile("ready", []byte(fmt.Sprintf("%.3f\n", time.Since(start).Seconds())), 0o644); err != nil {
		return err
	}
	logf("%d node(s) Ready after %.1fs; kubeconfig: %s", cfg.nodes, time.Since(start).Seconds(), filepath.Join(dir, "kubeconfig"))
	<-ctx.Done()
	return nil
}

func (c *cluster) startControlPlane() error {
	ca, err := newCA()
	if err != nil {
		return err
	}
	c.ca = ca
	pki := filepath.Join(c.dir, "pki")
	if _, err := c.writeFile("pki/ca.crt", ca.certPEM, 0o644); err != nil {
		return err
	}
	if err := writeServiceAccountKey(pki); err != nil {
		return err
	}
	serving, servingKey, err := ca.issue("kube-apiserver", nil,
		[]net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("10.0.0.1")},
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}, true)
	if err != nil {
		return err
	}
	if _, err := c.writeFile("pki/apiserver.crt", serving, 0o644); err != nil {
		return err
	}
	if _, err := c.writeFile("pki/apiserver.key", servingKey, 0o600); err != nil {
		return err
	}
	kcCert, kcKey, err := ca.issue("kube-apiserver-kubelet-client", []string{"kubeadm:cluster-admins"}, nil, nil, false)
	if err != nil {
		return err
	}
	if _, err := c.writeFile("pki/apiserver-kubelet-client.crt", kcCert, 0o644); err != nil {
		return err
	}
	if _, err := c.writeFile("pki/apiserver-kubelet-client.key", kcKey, 0o600); err != nil {
		return err
	}
	adminCert, adminKey, err := ca.issue("kubernetes-admin", []string{"system:masters"}, nil, nil, false)
	if err != nil {
		return err
	}
	adminKC, err := c.writeFile("kubeconfig", kubeconfig(c.apiURL, ca.certPEM, adminCert, adminKey, "", ""), 0o600)
	if err != nil {
		return err
	}
	// The admin credentials as files too, for clients configured without a kubeconfig parser.
	if _, err := c.writeFile("pki/admin.crt", adminCert, 0o644); err != nil {
		return err
	}
	if _, err := c.writeFile("pki/admin.key", adminKey, 0o600); err != nil {
		return err
	}
	fields := map[string]string{
		"server": c.apiURL, "kubeconfig": adminKC, "caFile": filepath.Join(pki, "ca.crt"),
		"adminCertFile": filepath.Join(pki, "admin.crt"), "adminKeyFile": filepath.Join(pki, "admin.key"),
		"clusterDomain": clusterDomain,
	}
	if c.dns != nil {
		fields["dnsIP"] = c.dns.ip
	}
	info, _ := json.MarshalIndent(fields, "", "  ")
	if _, err := c.writeFile("cluster.json", info, 0o644); err != nil {
		return err
	}
	schedKC, err := c.writeClientKubeconfig("scheduler", "system:kube-scheduler", nil)
	if err != nil {
		return err
	}
	kcmKC, err := c.writeClientKubeconfig("controller-manager", "system:kube-controller-manager", nil)
	if err != nil {
		return err
	}

	etcdPort, etcdPeer := mustFreePort(), mustFreePort()
	if _, err := c.startChild("etcd", "_etcd", filepath.Join(c.dir, "etcd"), strconv.Itoa(etcdPort), strconv.Itoa(etcdPeer)); err != nil {
		return err
	}
	if err := waitTCP(c.ctx, fmt.Sprintf("127.0.0.1:%d", etcdPort), 60*time.Second); err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	tol := strconv.Itoa(c.cfg.tolerationSecs)
	if _, err := c.startChild("kube-apiserver", "_apiserver",
		fmt.Sprintf("--etcd-servers=http://127.0.0.1:%d", etcdPort),
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", c.apiPort),
		"--tls-cert-file="+filepath.Join(pki, "apiserver.crt"),
		"--tls-private-key-file="+filepath.Join(pki, "apiserver.key"),
		"--client-ca-file="+filepath.Join(pki, "ca.crt"),
		"--authorization-mode=Node,RBAC",
		"--enable-admission-plugins=NodeRestriction",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+filepath.Join(pki, "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(pki, "sa.key"),
		"--service-cluster-ip-range=10.0.0.0/24",
		// The kubernetes Service's endpoints would point at a loopback address, which
		// endpoint validation rejects; pods reach the API server through their kubeconfig.
		"--endpoint-reconciler-type=none",
		"--allow-privileged=true",
		"--kubelet-client-certificate="+filepath.Join(pki, "apiserver-kubelet-client.crt"),
		"--kubelet-client-key="+filepath.Join(pki, "apiserver-kubelet-client.key"),
		"--kubelet-preferred-address-types=InternalIP",
		// Short default tolerations so taint-based eviction after node loss is test-sized.
		"--default-not-ready-toleration-seconds="+tol,
		"--default-unreachable-toleration-seconds="+tol,
		"--profiling=false",
		// Gang scheduling (Kubernetes 1.37 beta): serve scheduling.k8s.io/v1beta1 PodGroups
		// (a beta API group, off by default) and accept pods' spec.schedulingGroup.
		"--feature-gates="+genericWorkloadGate,
		"--runtime-config=scheduling.k8s.io/v1beta1=true",
		"--v=1",
	); err != nil {
		return err
	}
	restCfg, err := clientcmd.BuildConfigFromFlags("", adminKC)
	if err != nil {
		return err
	}
	restCfg.QPS, restCfg.Burst = 100, 200
	c.admin, err = kubernetes.NewForConfig(restCfg)
	if err != nil {
		return err
	}
	if err := c.waitAPIReady(120 * time.Second); err != nil {
		return err
	}
	grace := c.cfg.nodeMonitorGrace
	if _, err := c.startChild("kube-controller-manager", "_controller-manager",
		"--kubeconfig="+kcmKC,
		"--authentication-kubeconfig="+kcmKC,
		"--authorization-kubeconfig="+kcmKC,
		"--bind-address=127.0.0.1",
		"--secure-port=0",
		"--leader-elect=false",
		"--use-service-account-credentials=true",
		"--service-account-private-key-file="+filepath.Join(pki, "sa.key"),
		"--root-ca-file="+filepath.Join(pki, "ca.crt"),
		"--controllers="+strings.Join([]string{
			"garbage-collector-controller", "namespace-controller", "serviceaccount-controller",
			"serviceaccount-token-controller", "root-ca-certificate-publisher-controller",
			"node-lifecycle-controller", "taint-eviction-controller", "pod-garbage-collector-controller",
			"replicaset-controller", "deployment-controller", "statefulset-controller", "job-controller",
			"endpointslice-controller", "disruption-controller", "ttl-after-finished-controller",
			"cronjob-controller", "clusterrole-aggregation-controller", "resourcequota-controller",
			// Removes the scheduling.k8s.io/podgroup-protection finalizer once no pod uses
			// the PodGroup; without it a deleted PodGroup would stay forever.
			"podgroup-protection-controller",
		}, ","),
		"--feature-gates="+genericWorkloadGate,
		"--node-monitor-period=1s",
		fmt.Sprintf("--node-monitor-grace-period=%s", grace),
		"--node-startup-grace-period=30s",
		"--concurrent-gc-syncs=10",
		"--v=1",
	); err != nil {
		return err
	}
	if _, err := c.startChild("kube-scheduler", "_scheduler",
		"--kubeconfig="+schedKC,
		"--authentication-kubeconfig="+schedKC,
		"--authorization-kubeconfig="+schedKC,
		"--bind-address=127.0.0.1",
		"--secure-port=0",
		"--leader-elect=false",
		// The GangScheduling plugin (all-or-nothing binding of a PodGroup's pods).
		"--feature-gates="+genericWorkloadGate,
		"--v=1",
	); err != nil {
		return err
	}
	return nil
}

// genericWorkloadGate turns on the Workload/PodGroup API in the API server, the
// GangScheduling plugin in the scheduler and the PodGroup protection controller.
const genericWorkloadGate = "GenericWorkload=true"

func (c *cluster) waitAPIReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		if c.ctx.Err() != nil {
			return errors.New("stopped while waiting for kube-apiserver")
		}
		ctx, cancel := context.WithTimeout(c.ctx, 5*time.Second)
		body, err := c.admin.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		cancel()
		if err == nil && strings.TrimSpace(string(body)) == "ok" {
			// The bootstrap RBAC roles are created by a post-start hook; wait for one we need.
			if _, err := c.admin.RbacV1().ClusterRoles().Get(c.ctx, "system:node", metav1.GetOptions{}); err == nil {
				return nil
			}
		}
		last = err
		time.Sleep(250 * time.Millisecond)
	}
	return fmt.Errorf("kube-apiserver not ready after %s (last error: %v); see %s", timeout, last, filepath.Join(c.dir, "logs", "kube-apiserver.log"))
}

func (c *cluster) waitNodesReady() error {
	deadline := time.Now().Add(120 * time.Second)
	for time.Now().Before(deadline) {
		if c.ctx.Err() != nil {
			return errors.New("stopped while waiting for nodes")
		}
		nodes, err := c.admin.CoreV1().Nodes().List(c.ctx, metav1.ListOptions{})
		if err == nil {
			ready := 0
			for _, n := range nodes.Items {
				for _, cond := range n.Status.Conditions {
					if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue {
						ready++
					}
				}
			}
			if ready >= c.cfg.nodes {
				return nil
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	return errors.New("nodes not Ready within 120s")
}

// addNode starts a new node agent named node-<n>.
func (c *cluster) addNode(spot bool) (string, error) {
	c.mu.Lock()
	name := fmt.Sprintf("node-%d", c.nextNode)
	c.nextNode++
	c.mu.Unlock()
	a, err := newAgent(c, name, spot)
	if err != nil {
		return "", err
	}
	c.mu.Lock()
	c.agents[name] = a
	c.mu.Unlock()
	go a.run()
	return name, nil
}

func (c *cluster) shutdown() {
	c.shutdownMu.Lock()
	defer c.shutdownMu.Unlock()
	c.cancel()
	c.mu.Lock()
	agents := make([]*agent, 0, len(c.agents))
	for _, a := range c.agents {
		agents = append(agents, a)
	}
	c.mu.Unlock()
	var wg sync.WaitGroup
	for _, a := range agents {
		wg.Add(1)
		go func() { defer wg.Done(); a.killAll(2 * time.Second) }()
	}
	wg.Wait()
	if c.controlSock != "" {
		_ = os.Remove(c.controlSock)
	}
	_ = os.Remove(filepath.Join(c.dir, "ready"))
	// Reverse start order: scheduler, controller-manager, apiserver, etcd.
	for i := len(c.children) - 1; i >= 0; i-- {
		stopChild(c.children[i], 10*time.Second)
	}
	c.logf("stopped")
}

// httpServe runs an HTTP server until the cluster stops.
func (c *cluster) httpServe(l net.Listener, h http.Handler) {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-c.ctx.Done()
		_ = srv.Close()
	}()
	go func() { _ = srv.Serve(l) }()
}
