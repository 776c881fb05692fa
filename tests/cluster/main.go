// Command localcluster runs a real local Kubernetes control plane (etcd, kube-apiserver,
// kube-scheduler, kube-controller-manager from k8s.io/kubernetes) plus node agents that run
// each pod's containers as local processes. See README.md.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

const usage = `usage:
  localcluster up --dir DIR [--nodes N] [--spot-nodes M] [--gpus-per-node K] [--cpu 8] [--memory 32Gi]
                  [--pod-path-prefix DIRS] [--toleration-seconds S] [--node-monitor-grace 8s]
  localcluster preempt NODE --provider aws|gke|karpenter|autoscaler --grace SECONDS --dir DIR [--wait] [--cordon-only]
  localcluster kill-node NODE --dir DIR
  localcluster freeze-node NODE --seconds S --dir DIR [--wait]   (a network blip: no Lease, processes stopped, then back)
  localcluster add-node --dir DIR [--spot]
  localcluster nodes --dir DIR
  localcluster stop-apiserver --dir DIR    (SIGTERM kube-apiserver; etcd and every other part keep running)
  localcluster start-apiserver --dir DIR   (the same kube-apiserver again; returns once it is ready)
  localcluster kubectl ARGS...     (kubectl built from the same k8s.io/kubernetes)
`

func main() {
	// A symlink named kubectl runs kubectl directly.
	if filepath.Base(os.Args[0]) == "kubectl" {
		os.Exit(runKubectl())
	}
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	cmd, args := os.Args[1], os.Args[2:]
	switch cmd {
	case containerInitCmd:
		os.Exit(runContainerInit(args))
	case "kubectl":
		os.Args = append([]string{"kubectl"}, args...)
		os.Exit(runKubectl())
	case "_apiserver":
		os.Exit(runAPIServer(args))
	case "_scheduler":
		os.Exit(runScheduler(args))
	case "_controller-manager":
		os.Exit(runControllerManager(args))
	case "_etcd":
		if len(args) != 3 {
			os.Exit(2)
		}
		cp, _ := strconv.Atoi(args[1])
		pp, _ := strconv.Atoi(args[2])
		os.Exit(runEtcd(args[0], cp, pp))
	case "up":
		os.Exit(cmdUp(args))
	case "preempt", "kill-node", "freeze-node", "add-node", "nodes", "stop-apiserver", "start-apiserver":
		os.Exit(cmdFault(cmd, args))
	case "-h", "--help", "help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "unknown command %q\n%s", cmd, usage)
		os.Exit(2)
	}
}

func cmdUp(args []string) int {
	fs := flag.NewFlagSet("up", flag.ExitOnError)
	cfg := upConfig{}
	fs.IntVar(&cfg.nodes, "nodes", 1, "number of nodes")
	fs.StringVar(&cfg.dir, "dir", "", "state directory (kubeconfig, logs, pod dirs)")
	fs.IntVar(&cfg.gpusPerNode, "gpus-per-node", 0, "nvidia.com/gpu capacity per node")
	fs.IntVar(&cfg.spotNodes, "spot-nodes", 0, "how many of the nodes carry spot capacity-type labels")
	fs.StringVar(&cfg.cpu, "cpu", "8", "cpu capacity per node")
	fs.StringVar(&cfg.memory, "memory", "32Gi", "memory capacity per node")
	fs.StringVar(&cfg.podPathPrefix, "pod-path-prefix", "", "directories put first on every container's PATH (colon-separated)")
	fs.IntVar(&cfg.tolerationSecs, "toleration-seconds", 10, "default not-ready/unreachable toleration seconds (DefaultTolerationSeconds admission)")
	fs.DurationVar(&cfg.nodeMonitorGrace, "node-monitor-grace", 8*time.Second, "kube-controller-manager --node-monitor-grace-period")
	_ = fs.Parse(args)
	if cfg.dir == "" {
		fmt.Fprint(os.Stderr, "up: --dir is required\n"+usage)
		return 2
	}
	return runUp(cfg)
}

func cmdFault(cmd string, args []string) int {
	var node string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		node, args = args[0], args[1:]
	}
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	dir := fs.String("dir", "", "the directory given to `up`")
	provider := fs.String("provider", "aws", "aws|gke|karpenter|autoscaler")
	grace := fs.Int("grace", 120, "seconds from the notice until the machine is gone")
	wait := fs.Bool("wait", false, "return only after the machine is gone (freeze-node: back)")
	cordonOnly := fs.Bool("cordon-only", false, "aws/karpenter/autoscaler: taint and cordon but do not drain")
	spot := fs.Bool("spot", false, "add-node: spot capacity")
	seconds := fs.Float64("seconds", 0, "freeze-node: how long the node is cut off")
	_ = fs.Parse(args)
	if node == "" && fs.NArg() > 0 {
		node = fs.Arg(0)
	}
	if *dir == "" {
		fmt.Fprintf(os.Stderr, "%s: --dir is required\n%s", cmd, usage)
		return 2
	}
	if (cmd == "preempt" || cmd == "kill-node" || cmd == "freeze-node") && node == "" {
		fmt.Fprintf(os.Stderr, "%s: NODE is required\n%s", cmd, usage)
		return 2
	}
	if cmd == "freeze-node" && *seconds <= 0 {
		fmt.Fprintf(os.Stderr, "freeze-node: --seconds S > 0 is required\n%s", usage)
		return 2
	}
	req := controlRequest{Node: node, Provider: *provider, Grace: *grace, Wait: *wait, CordonOnly: *cordonOnly, Spot: *spot, Seconds: *seconds}
	resp, err := controlCall(*dir, "/"+cmd, req)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", cmd, err)
		return 1
	}
	switch {
	case cmd == "nodes":
		fmt.Println(strings.Join(resp.Nodes, "\n"))
	case resp.Node != "":
		fmt.Println(resp.Node)
	}
	if resp.Message != "" {
		fmt.Fprintln(os.Stderr, resp.Message)
	}
	return 0
}
