package main

// A pod's view of names, as the kubelet and the container runtime arrange it: its own
// /etc/resolv.conf (dnsPolicy, dnsConfig), a kubelet-style /etc/hosts (the pod IP with its
// hostname and FQDN, hostAliases) and its hostname. Each container starts as this binary's
// hidden `_container` subcommand in a new mount and UTS namespace (Go's fork unshares them and
// makes / private), which bind-mounts the pod's files over /etc/resolv.conf and /etc/hosts, sets
// the hostname and then execs the container's command in place (same PID, process group,
// Pdeathsig, signals and exit status). Where namespaces are refused, containers start as before.

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	corev1 "k8s.io/api/core/v1"
)

const containerInitCmd = "_container"

// podHostname is the pod's hostname as the kubelet sets it: spec.hostname, else the pod name
// cut to 63 characters (without a trailing '-' or '.').
func podHostname(p *corev1.Pod) string {
	if p.Spec.Hostname != "" {
		return p.Spec.Hostname
	}
	h := p.Name
	if len(h) > 63 {
		h = strings.TrimRight(h[:63], "-.")
	}
	return h
}

// podFQDN is <hostname>.<subdomain>.<ns>.svc.<domain>, or "" without a subdomain.
func podFQDN(p *corev1.Pod) string {
	if p.Spec.Subdomain == "" {
		return ""
	}
	return fmt.Sprintf("%s.%s.%s.svc.%s", podHostname(p), p.Spec.Subdomain, p.Namespace, clusterDomain)
}

// podResolvConf is the pod's resolv.conf as the kubelet writes it for its dnsPolicy and
// dnsConfig. dnsIP is "" when the cluster DNS is not serving (ClusterFirst then falls back to
// the host's file, as the kubelet does without --cluster-dns).
func podResolvConf(p *corev1.Pod, dnsIP string) ([]byte, error) {
	policy := p.Spec.DNSPolicy
	if policy == "" {
		policy = corev1.DNSClusterFirst
	}
	cluster := dnsIP != "" && (policy == corev1.DNSClusterFirstWithHostNet || (policy == corev1.DNSClusterFirst && !p.Spec.HostNetwork))
	if !cluster && policy != corev1.DNSNone && p.Spec.DNSConfig == nil {
		return os.ReadFile(hostResolvConf) // Default: the node's own file
	}
	var rc resolvConf
	switch {
	case policy == corev1.DNSNone:
	case cluster:
		host, _ := parseResolvConf(hostResolvConf)
		rc.nameservers = []string{dnsIP}
		rc.searches = append([]string{
			p.Namespace + ".svc." + clusterDomain, "svc." + clusterDomain, clusterDomain,
		}, host.searches...)
		rc.options = []string{"ndots:5"}
	default:
		host, err := parseResolvConf(hostResolvConf)
		if err != nil {
			return nil, err
		}
		rc = host
	}
	if dc := p.Spec.DNSConfig; dc != nil {
		rc.nameservers = append(rc.nameservers, dc.Nameservers...)
		rc.searches = append(rc.searches, dc.Searches...)
		for _, o := range dc.Options {
			opt := o.Name
			if o.Value != nil {
				opt += ":" + *o.Value
			}
			// A dnsConfig option replaces one of the same name.
			kept := rc.options[:0]
			for _, have := range rc.options {
				if n, _, _ := strings.Cut(have, ":"); n != o.Name {
					kept = append(kept, have)
				}
			}
			rc.options = append(kept, opt)
		}
	}
	var b strings.Builder
	b.WriteString("# Kubernetes-managed resolv.conf (localcluster)\n")
	seen := map[string]bool{}
	n := 0
	for _, ns := range rc.nameservers {
		if !seen["ns "+ns] && n < 3 { // the resolver reads at most 3
			seen["ns "+ns] = true
			n++
			fmt.Fprintf(&b, "nameserver %s\n", ns)
		}
	}
	var search []string
	for _, s := range rc.searches {
		if !seen["s "+s] {
			seen["s "+s] = true
			search = append(search, s)
		}
	}
	if len(search) > 0 {
		fmt.Fprintf(&b, "search %s\n", strings.Join(search, " "))
	}
	if len(rc.options) > 0 {
		fmt.Fprintf(&b, "options %s\n", strings.Join(rc.options, " "))
	}
	return []byte(b.String()), nil
}

// podHosts is the kubelet's managed /etc/hosts for a pod.
func podHosts(p *corev1.Pod, podIP string) []byte {
	var b strings.Builder
	b.WriteString("# Kubernetes-managed hosts file (localcluster).\n")
	b.WriteString("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
	b.WriteString("fe00::0\tip6-localnet\nfe00::0\tip6-mcastprefix\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n")
	if fqdn := podFQDN(p); fqdn != "" {
		fmt.Fprintf(&b, "%s\t%s\t%s\n", podIP, fqdn, podHostname(p))
	} else {
		fmt.Fprintf(&b, "%s\t%s\n", podIP, podHostname(p))
	}
	if len(p.Spec.HostAliases) > 0 {
		b.WriteString("\n# Entries added by HostAliases.\n")
		for _, ha := range p.Spec.HostAliases {
			fmt.Fprintf(&b, "%s\t%s\n", ha.IP, strings.Join(ha.Hostnames, "\t"))
		}
	}
	return []byte(b.String())
}

// containerInitArgs writes the pod's resolv.conf and hosts files (under the pod's directory)
// and returns the `_container` arguments that mount them and set the hostname before argv runs.
// A hostNetwork pod keeps the node's hostname and /etc/hosts, as in Kubernetes.
func (w *podWorker) containerInitArgs(argv []string) ([]string, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	dnsIP := ""
	if d := w.a.c.dns; d != nil {
		dnsIP = d.ip
	}
	resolv, err := podResolvConf(w.pod, dnsIP)
	if err != nil {
		return nil, fmt.Errorf("resolv.conf: %w", err)
	}
	etc := filepath.Join(w.dir, "etc")
	if err := os.MkdirAll(etc, 0o755); err != nil {
		return nil, err
	}
	resolvPath := filepath.Join(etc, "resolv.conf")
	if err := os.WriteFile(resolvPath, resolv, 0o644); err != nil {
		return nil, err
	}
	args := []string{self, containerInitCmd, "--resolv", resolvPath}
	if !w.pod.Spec.HostNetwork {
		hostsPath := filepath.Join(etc, "hosts")
		if err := os.WriteFile(hostsPath, podHosts(w.pod, w.podIP), 0o644); err != nil {
			return nil, err
		}
		args = append(args, "--hosts", hostsPath, "--hostname", podHostname(w.pod))
	}
	return append(append(args, "--"), argv...), nil
}

// containerUnshare is what Go's fork does for `_container` before it runs.
const containerUnshare = syscall.CLONE_NEWNS | syscall.CLONE_NEWUTS

// runContainerInit is `localcluster _container [--resolv F] [--hosts F] [--hostname H] -- ARGV`,
// run in its own mount and UTS namespace: it mounts the files, sets the hostname and execs
// ARGV. A step that fails is reported on stderr (the container's log) and skipped.
func runContainerInit(args []string) int {
	var resolv, hosts, hostname string
	for len(args) > 0 && args[0] != "--" {
		if len(args) < 2 {
			fmt.Fprintf(os.Stderr, "localcluster %s: %q needs a value\n", containerInitCmd, args[0])
			return 127
		}
		switch args[0] {
		case "--resolv":
			resolv = args[1]
		case "--hosts":
			hosts = args[1]
		case "--hostname":
			hostname = args[1]
		default:
			fmt.Fprintf(os.Stderr, "localcluster %s: unknown flag %q\n", containerInitCmd, args[0])
			return 127
		}
		args = args[2:]
	}
	if len(args) < 2 {
		fmt.Fprintf(os.Stderr, "localcluster %s: no command after --\n", containerInitCmd)
		return 127
	}
	argv := args[1:]
	var problems []string
	for _, m := range [][2]string{{resolv, "/etc/resolv.conf"}, {hosts, "/etc/hosts"}} {
		if m[0] == "" {
			continue
		}
		if err := syscall.Mount(m[0], m[1], "", syscall.MS_BIND, ""); err != nil {
			problems = append(problems, fmt.Sprintf("bind-mounting %s over %s: %v", m[0], m[1], err))
		}
	}
	if hostname != "" {
		if err := syscall.Sethostname([]byte(hostname)); err != nil {
			problems = append(problems, fmt.Sprintf("setting the hostname %q: %v", hostname, err))
		}
	}
	if len(problems) > 0 {
		fmt.Fprintf(os.Stderr, "localcluster: %s; the container sees the host's instead\n", strings.Join(problems, "; "))
	}
	err := syscall.Exec(argv[0], argv, os.Environ())
	fmt.Fprintf(os.Stderr, "localcluster: exec %s: %v\n", argv[0], err)
	return 127
}
