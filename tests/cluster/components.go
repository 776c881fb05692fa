package main

// Each control-plane component runs in its own re-executed process of this binary. Running
// them in one process collides on process-global state: feature gates registered twice,
// signal handlers that may be installed once, klog and the legacy metrics registries.

import (
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	_ "k8s.io/client-go/plugin/pkg/client/auth" // client auth plugins, as kubectl's main does
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format, as the upstream mains do
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics, as the upstream mains do
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric, as the upstream mains do
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserverapp "k8s.io/kubernetes/cmd/kube-apiserver/app"
	kcmapp "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	schedulerapp "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

// runAPIServer runs kube-apiserver from its app package with the given flags.
func runAPIServer(args []string) int {
	command := apiserverapp.NewAPIServerCommand()
	command.SetArgs(args)
	return cli.Run(command)
}

// runScheduler runs kube-scheduler from its app package with the given flags.
func runScheduler(args []string) int {
	command := schedulerapp.NewSchedulerCommand()
	command.SetArgs(args)
	return cli.Run(command)
}

// runControllerManager runs kube-controller-manager from its app package with the given flags.
func runControllerManager(args []string) int {
	command := kcmapp.NewControllerManagerCommand()
	command.SetArgs(args)
	return cli.Run(command)
}

// runKubectl runs kubectl exactly as k8s.io/kubernetes/cmd/kubectl's main does. It reads
// os.Args itself, so the caller rewrites os.Args to drop the "kubectl" subcommand first.
func runKubectl() int {
	logs.GlogSetter(kubectlcmd.GetLogVerbosity(os.Args)) //nolint:errcheck // same as upstream main
	command := kubectlcmd.NewDefaultKubectlCommand()
	if err := cli.RunNoErrOutput(command); err != nil {
		kubectlutil.CheckErr(err)
	}
	return 0
}

// runEtcd runs a single-member embedded etcd on loopback until SIGTERM or SIGINT.
func runEtcd(dir string, clientPort, peerPort int) int {
	cfg := embed.NewConfig()
	cfg.Name = "localcluster"
	cfg.Dir = dir
	// No fsync: the data is thrown away with the cluster and fsync dominates etcd's latency.
	cfg.UnsafeNoFsync = true
	cfg.LogLevel = "warn"
	client := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", clientPort)}
	peer := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort)}
	cfg.ListenClientUrls = []url.URL{client}
	cfg.AdvertiseClientUrls = []url.URL{client}
	cfg.ListenPeerUrls = []url.URL{peer}
	cfg.AdvertisePeerUrls = []url.URL{peer}
	cfg.ListenMetricsUrls = nil
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "etcd: start: %v\n", err)
		return 1
	}
	defer e.Close()
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		fmt.Fprintln(os.Stderr, "etcd: not ready after 60s")
		return 1
	}
	fmt.Fprintf(os.Stderr, "etcd: ready on %s\n", client.String())
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case <-sig:
		return 0
	case err := <-e.Err():
		fmt.Fprintf(os.Stderr, "etcd: %v\n", err)
		return 1
	}
}
