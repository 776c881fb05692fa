package main

// Cluster DNS, as CoreDNS serves it in a real cluster: A records for the names the Kubernetes
// DNS specification defines, on the cluster's own loopback address 127.B.255.10 port 53 (UDP
// and TCP). Names outside the cluster domain are forwarded to the host's nameservers. Pods see
// it through the resolv.conf that podnet.go bind-mounts over their /etc/resolv.conf.
//
// A real CoreDNS reads EndpointSlices. Here the endpointslice controller runs but cannot write
// them: EndpointSlice validation refuses loopback addresses, and every pod IP is one. So the
// server derives a Service's endpoints from Services and Pods (informers) exactly as that
// controller would: the pods its selector matches that have an IP and are not terminal; ready
// if the pod is Ready (and not terminating) or the Service publishes not-ready addresses; the
// pod's spec.hostname as the endpoint's hostname when its spec.subdomain names this headless
// Service.

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
)

const (
	clusterDomain   = "cluster.local"
	hostResolvConf  = "/etc/resolv.conf"
	dnsTTL          = 5
	upstreamTimeout = 2 * time.Second
)

// resolvConf is the part of a resolv.conf file that matters here.
type resolvConf struct {
	nameservers []string
	searches    []string
	options     []string
}

func parseResolvConf(path string) (resolvConf, error) {
	var rc resolvConf
	f, err := os.Open(path)
	if err != nil {
		return rc, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 || strings.HasPrefix(fields[0], "#") || strings.HasPrefix(fields[0], ";") {
			continue
		}
		switch fields[0] {
		case "nameserver":
			if len(fields) > 1 {
				rc.nameservers = append(rc.nameservers, fields[1])
			}
		case "search", "domain":
			rc.searches = append(rc.searches, fields[1:]...)
		case "options":
			rc.options = append(rc.options, fields[1:]...)
		}
	}
	return rc, sc.Err()
}

type clusterDNS struct {
	ip       string // the server's address, 127.B.255.10 (pod IPs are 127.B.x.y with x < 254)
	domain   string
	upstream []string // host:port of the host's nameservers
	udp      net.PacketConn
	tcp      net.Listener
	services corelisters.ServiceLister
	pods     corelisters.PodLister
	logf     func(string, ...any)
}

// listenDNS binds the cluster's DNS address (UDP and TCP port 53); it does not answer
// until serve is called.
func listenDNS(ipBlock int, logf func(string, ...any)) (*clusterDNS, error) {
	d := &clusterDNS{ip: fmt.Sprintf("127.%d.255.10", ipBlock), domain: clusterDomain, logf: logf}
	rc, err := parseResolvConf(hostResolvConf)
	if err != nil {
		logf("cluster DNS: reading the host's %s: %v (names outside %s will not resolve in pods)", hostResolvConf, err, d.domain)
	}
	for _, ns := range rc.nameservers {
		if ns != d.ip {
			d.upstream = append(d.upstream, net.JoinHostPort(ns, "53"))
		}
	}
	addr := net.JoinHostPort(d.ip, "53")
	if d.udp, err = net.ListenPacket("udp4", addr); err != nil {
		return nil, err
	}
	if d.tcp, err = net.Listen("tcp4", addr); err != nil {
		d.udp.Close()
		return nil, err
	}
	return d, nil
}

// serve fills the Service and Pod caches, then answers until ctx ends.
func (d *clusterDNS) serve(ctx context.Context, client kubernetes.Interface) error {
	f := informers.NewSharedInformerFactory(client, 0)
	d.services = f.Core().V1().Services().Lister()
	d.pods = f.Core().V1().Pods().Lister()
	f.Start(ctx.Done())
	syncCtx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for typ, ok := range f.WaitForCacheSync(syncCtx.Done()) {
		if !ok {
			return fmt.Errorf("cluster DNS: the %v cache did not sync within 60s", typ)
		}
	}
	go func() {
		<-ctx.Done()
		d.udp.Close()
		d.tcp.Close()
		f.Shutdown()
	}()
	go d.serveUDP()
	go d.serveTCP()
	return nil
}

func (d *clusterDNS) serveUDP() {
	buf := make([]byte, 65535)
	for {
		n, addr, err := d.udp.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		q := append([]byte(nil), buf[:n]...)
		go func() {
			if resp := d.handle(q, false); resp != nil {
				_, _ = d.udp.WriteTo(resp, addr)
			}
		}()
	}
}

func (d *clusterDNS) serveTCP() {
	for {
		conn, err := d.tcp.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		go func() {
			defer conn.Close()
			for {
				_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
				q, err := readTCPMessage(conn)
				if err != nil {
					return
				}
				resp := d.handle(q, true)
				if resp == nil || writeTCPMessage(conn, resp) != nil {
					return
				}
			}
		}()
	}
}

func readTCPMessage(r io.Reader) ([]byte, error) {
	var n [2]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return nil, err
	}
	msg := make([]byte, binary.BigEndian.Uint16(n[:]))
	_, err := io.ReadFull(r, msg)
	return msg, err
}

func writeTCPMessage(w io.Writer, msg []byte) error {
	out := binary.BigEndian.AppendUint16(make([]byte, 0, len(msg)+2), uint16(len(msg)))
	_, err := w.Write(append(out, msg...))
	return err
}

// handle answers one query message; nil means no answer (unparseable input).
func (d *clusterDNS) handle(query []byte, tcp bool) []byte {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil || h.Response {
		return nil
	}
	qs, err := p.AllQuestions()
	if err != nil || len(qs) != 1 || h.OpCode != 0 {
		return d.reply(h, qs, dnsmessage.RCodeFormatError, nil, tcp, 512)
	}
	maxUDP := 512
	if p.SkipAllAnswers() == nil && p.SkipAllAuthorities() == nil {
		if extra, err := p.AllAdditionals(); err == nil {
			for _, r := range extra {
				if r.Header.Type == dnsmessage.TypeOPT && int(r.Header.Class) > maxUDP {
					maxUDP = int(r.Header.Class) // EDNS0: the requester's UDP payload size
				}
			}
		}
	}
	q := qs[0]
	name := strings.ToLower(strings.TrimSuffix(q.Name.String(), "."))
	ips, exists, ours := d.lookup(name)
	if !ours {
		return d.forward(h, qs, query, tcp)
	}
	if !exists {
		return d.reply(h, qs, dnsmessage.RCodeNameError, nil, tcp, maxUDP)
	}
	if q.Type != dnsmessage.TypeA && q.Type != dnsmessage.TypeALL {
		ips = nil // the name exists, with no record of this type (NODATA)
	}
	return d.reply(h, qs, dnsmessage.RCodeSuccess, ips, tcp, maxUDP)
}

func (d *clusterDNS) reply(h dnsmessage.Header, qs []dnsmessage.Question, rcode dnsmessage.RCode, ips []netip.Addr, tcp bool, maxUDP int) []byte {
	msg := dnsmessage.Message{
		Header: dnsmessage.Header{
			ID: h.ID, Response: true, Authoritative: rcode != dnsmessage.RCodeFormatError,
			RecursionDesired: h.RecursionDesired, RecursionAvailable: true, RCode: rcode,
		},
		Questions: qs,
	}
	for _, ip := range ips {
		msg.Answers = append(msg.Answers, dnsmessage.Resource{
			Header: dnsmessage.ResourceHeader{Name: qs[0].Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: dnsTTL},
			Body:   &dnsmessage.AResource{A: ip.As4()},
		})
	}
	out, err := msg.Pack()
	if err == nil && !tcp && len(out) > maxUDP {
		msg.Answers, msg.Header.Truncated = nil, true // the client retries over TCP
		out, err = msg.Pack()
	}
	if err != nil {
		return nil
	}
	return out
}

// lookup resolves a lower-case name without the trailing dot. ours is false for names outside
// the cluster domain; exists is false for names inside it that do not exist (NXDOMAIN).
func (d *clusterDNS) lookup(name string) (ips []netip.Addr, exists, ours bool) {
	if name == d.domain {
		return nil, true, true
	}
	rest, ok := strings.CutSuffix(name, "."+d.domain)
	if !ok {
		return nil, false, false
	}
	l := strings.Split(rest, ".")
	switch {
	case len(l) <= 2 && l[len(l)-1] == "svc": // svc.<domain>, <ns>.svc.<domain>
		return nil, true, true
	case len(l) == 3 && l[2] == "svc":
		ips, exists = d.serviceIPs(l[1], l[0])
		return ips, exists, true
	case len(l) == 4 && l[3] == "svc":
		ips, exists = d.endpointIPs(l[2], l[1], l[0])
		return ips, exists, true
	case len(l) == 3 && l[2] == "pod": // <a-b-c-d>.<ns>.pod.<domain> (CoreDNS "pods insecure")
		if ip, err := netip.ParseAddr(strings.ReplaceAll(l[0], "-", ".")); err == nil && ip.Is4() {
			return []netip.Addr{ip}, true, true
		}
	}
	return nil, false, true
}

// serviceIPs: a ClusterIP Service's cluster IP; a headless Service's ready endpoints.
func (d *clusterDNS) serviceIPs(ns, name string) ([]netip.Addr, bool) {
	svc, err := d.services.Services(ns).Get(name)
	if err != nil {
		return nil, false
	}
	switch {
	case svc.Spec.Type == corev1.ServiceTypeExternalName:
		return nil, true // a CNAME in a real cluster; not served here
	case svc.Spec.ClusterIP != "" && svc.Spec.ClusterIP != corev1.ClusterIPNone:
		var ips []netip.Addr
		for _, s := range svc.Spec.ClusterIPs {
			if ip, err := netip.ParseAddr(s); err == nil && ip.Is4() {
				ips = append(ips, ip)
			}
		}
		return ips, true
	}
	return d.readyEndpoints(svc, func(*corev1.Pod, netip.Addr) bool { return true }), true
}

// endpointIPs resolves <host>.<svc>: the ready endpoint whose hostname is host (a pod with
// spec.hostname and spec.subdomain = svc), or whose address written with dashes is host.
func (d *clusterDNS) endpointIPs(ns, svcName, host string) ([]netip.Addr, bool) {
	svc, err := d.services.Services(ns).Get(svcName)
	if err != nil || svc.Spec.ClusterIP != corev1.ClusterIPNone {
		return nil, false
	}
	ips := d.readyEndpoints(svc, func(p *corev1.Pod, ip netip.Addr) bool {
		if p.Spec.Hostname != "" && p.Spec.Subdomain == svcName {
			return strings.EqualFold(p.Spec.Hostname, host)
		}
		return strings.ReplaceAll(ip.String(), ".", "-") == host
	})
	return ips, len(ips) > 0
}

// readyEndpoints: the IPv4 addresses of the Service's ready endpoints that match, in the
// endpointslice controller's terms (see the top of this file).
func (d *clusterDNS) readyEndpoints(svc *corev1.Service, match func(*corev1.Pod, netip.Addr) bool) []netip.Addr {
	if len(svc.Spec.Selector) == 0 {
		return nil
	}
	pods, err := d.pods.Pods(svc.Namespace).List(labels.SelectorFromSet(svc.Spec.Selector))
	if err != nil {
		return nil
	}
	publish := svc.Spec.PublishNotReadyAddresses
	seen := map[netip.Addr]bool{}
	var ips []netip.Addr
	for _, p := range pods {
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		if !publish && (p.DeletionTimestamp != nil || !podReady(p)) {
			continue
		}
		ip, err := netip.ParseAddr(p.Status.PodIP)
		if err != nil || !ip.Is4() || seen[ip] || !match(p, ip) {
			continue
		}
		seen[ip] = true
		ips = append(ips, ip)
	}
	return ips
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// forward relays a query for a name outside the cluster domain to the host's nameservers, in
// order, and their answer back; SERVFAIL if none answers.
func (d *clusterDNS) forward(h dnsmessage.Header, qs []dnsmessage.Question, query []byte, tcp bool) []byte {
	for _, up := range d.upstream {
		if resp, err := exchange(up, query, tcp); err == nil {
			return resp
		}
	}
	return d.reply(h, qs, dnsmessage.RCodeServerFailure, nil, true, 0)
}

func exchange(server string, query []byte, tcp bool) ([]byte, error) {
	network := "udp"
	if tcp {
		network = "tcp"
	}
	conn, err := net.DialTimeout(network, server, upstreamTimeout)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(upstreamTimeout))
	if tcp {
		if err := writeTCPMessage(conn, query); err != nil {
			return nil, err
		}
		return readTCPMessage(conn)
	}
	if _, err := conn.Write(query); err != nil {
		return nil, err
	}
	buf := make([]byte, 65535)
	for {
		n, err := conn.Read(buf)
		if err != nil {
			return nil, err
		}
		if n >= 12 && buf[0] == query[0] && buf[1] == query[1] {
			return append([]byte(nil), buf[:n]...), nil
		}
	}
}
