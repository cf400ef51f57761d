package cli

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

// The property test of injection (issue 10): random pods — container and pod security contexts
// with unset, root, shared and inherited UIDs, runAsGroup, fsGroup and supplementalGroups, skip
// lists on the pod or its namespace, sidecar modes, user native sidecars, Jobs — are injected by
// the webhook's code, their `detour rules` output is loaded into a real network namespace, and
// real TCP connections made as each identity of the pod show that
//   - the validator's probe is redirected (the validator passes), whatever the skip lists say;
//   - every user init container that the webhook gave egress reaches the remote directly;
//   - every app container, user sidecar, the pod's default identity (what a kubectl debug
//     container gets) and root are captured by the proxy's listener, unless a skip list covers
//     the destination;
//   - the proxy goes out directly, and UID 0 and GID 0 are never exempt.
//
// DETOUR_PROPERTY_SEED reproduces a run (every failure prints it, with the pod's index);
// DETOUR_PROPERTY_PODS sets how many pods a run checks (default 250).

const (
	propertyProxyPort = 4140
	propertyRemote    = 8080
)

var (
	propertyPodIP4     = netip.MustParseAddr("10.99.0.2")
	propertyRemoteIP4  = netip.MustParseAddr("10.99.0.1")
	propertyPodIP6     = netip.MustParseAddr("fd99::2")
	propertyRemoteIP6  = netip.MustParseAddr("fd99::1")
	propertyUIDs       = []int64{0, 1000, 1001, 1200, inject.DefaultValidatorUID, 2600, 2601, 2650, 3000, 65534}
	propertyGIDs       = []int64{0, 1000, 2600, 2601, 2602, 3000, 5000}
	propertyImageUsers = []uint32{0, 1000, 1001, 3000, 65534}
	propertySkipPorts  = []string{"80", "25", "8080", "1-1000", "8000-8100", "443,3306"}
	propertySkipCIDRs  = []string{"0.0.0.0/0", "::/0", "10.99.0.0/24", "10.99.0.1", "192.168.0.0/16", "fd99::/64", "fd00::/8", "203.0.113.0/24", "2001:db8::/32"}
)

// imageUser is what a container's image says about its user: the UID it runs as when no
// runAsUser applies, its group, and whether its /etc/passwd gives an explicit UID N the group N
// (images commonly do) rather than leaving it in group 0.
type imageUser struct {
	uid, gid     uint32
	mapsUIDToGID bool
}

// propertyCase is one random pod and the world it is admitted in.
type propertyCase struct {
	pod       *corev1.Pod
	ns        map[string]string
	native    bool // the cluster runs native sidecars
	cfgMode   string
	images    map[string]imageUser
	debugUser imageUser // the image of a kubectl debug container
	family    iptables.Family
}

func pick[T any](r *rand.Rand, s []T) T { return s[r.IntN(len(s))] }

func chance(r *rand.Rand, p float64) bool { return r.Float64() < p }

func randomSecurityContext(r *rand.Rand) *corev1.SecurityContext {
	if chance(r, 0.35) {
		return nil
	}
	sc := &corev1.SecurityContext{}
	if chance(r, 0.75) {
		sc.RunAsUser = ptrTo(pick(r, propertyUIDs))
	}
	if chance(r, 0.3) {
		sc.RunAsGroup = ptrTo(pick(r, propertyGIDs))
	}
	return sc
}

func ptrTo[T any](v T) *T { return &v }

func randomImageUser(r *rand.Rand) imageUser {
	u := imageUser{uid: pick(r, propertyImageUsers), mapsUIDToGID: chance(r, 0.7)}
	if chance(r, 0.6) {
		u.gid = u.uid
	}
	return u
}

func randomCase(r *rand.Rand) propertyCase {
	c := propertyCase{
		ns:        map[string]string{annotations.Inject: "enabled"},
		native:    chance(r, 0.5),
		cfgMode:   pick(r, []string{"auto", "container", "container", "native"}),
		images:    map[string]imageUser{},
		debugUser: imageUser{uid: 0, mapsUIDToGID: true},
		family:    pick(r, []iptables.Family{iptables.IPv4, iptables.IPv4, iptables.IPv6}),
	}
	pod := &corev1.Pod{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"}, ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "prop", Annotations: map[string]string{}}}
	if chance(r, 0.6) {
		psc := &corev1.PodSecurityContext{}
		if chance(r, 0.6) {
			psc.RunAsUser = ptrTo(pick(r, propertyUIDs))
		}
		if chance(r, 0.3) {
			psc.RunAsGroup = ptrTo(pick(r, propertyGIDs))
		}
		if chance(r, 0.3) {
			psc.FSGroup = ptrTo(pick(r, propertyGIDs))
		}
		if chance(r, 0.2) {
			psc.SupplementalGroups = []int64{pick(r, propertyGIDs), pick(r, propertyGIDs)}
		}
		pod.Spec.SecurityContext = psc
	}
	if chance(r, 0.2) {
		pod.Spec.RestartPolicy = pick(r, []corev1.RestartPolicy{corev1.RestartPolicyNever, corev1.RestartPolicyOnFailure})
	}
	var initNames []string
	for i := range r.IntN(5) {
		name := fmt.Sprintf("init-%d", i)
		ctr := corev1.Container{Name: name, Image: name + ":1", SecurityContext: randomSecurityContext(r)}
		if chance(r, 0.2) {
			ctr.RestartPolicy = ptrTo(corev1.ContainerRestartPolicyAlways)
		} else {
			initNames = append(initNames, name)
		}
		pod.Spec.InitContainers = append(pod.Spec.InitContainers, ctr)
		c.images[name] = randomImageUser(r)
	}
	for i := range 1 + r.IntN(3) {
		name := fmt.Sprintf("app-%d", i)
		pod.Spec.Containers = append(pod.Spec.Containers, corev1.Container{Name: name, Image: name + ":1", SecurityContext: randomSecurityContext(r)})
		c.images[name] = randomImageUser(r)
	}
	// User annotations, on the pod or on its namespace.
	where := func() map[string]string {
		if chance(r, 0.3) {
			return c.ns
		}
		return pod.Annotations
	}
	switch {
	case chance(r, 0.15):
		where()[annotations.InitEgress] = "none"
	case chance(r, 0.2) && len(initNames) > 0:
		where()[annotations.InitEgress] = strings.Join(initNames[:1+r.IntN(len(initNames))], ",")
	}
	if chance(r, 0.3) {
		pod.Annotations[annotations.SidecarMode] = pick(r, []string{"container", "native"})
	}
	if chance(r, 0.4) {
		where()[annotations.SkipOutboundPorts] = pick(r, propertySkipPorts)
	}
	if chance(r, 0.4) {
		nets := []string{pick(r, propertySkipCIDRs)}
		if chance(r, 0.5) {
			nets = append(nets, pick(r, propertySkipCIDRs))
		}
		where()[annotations.SkipOutboundCIDRs] = strings.Join(nets, ",")
	}
	c.pod = pod
	return c
}

// identity is who a container of the injected pod runs as, as the kubelet and the runtime
// resolve it: its own runAsUser, else the pod's, else its image's user; its own runAsGroup,
// else the pod's, else its image's group (for an explicit UID: N when the image maps uid N to
// group N, else 0); the pod's fsGroup and supplementalGroups as supplementary groups.
func (c propertyCase) identity(pod *corev1.Pod, ctr *corev1.Container, img imageUser) (testenv.Identity, []uint32) {
	var uid, gid *int64
	var groups []uint32
	if psc := pod.Spec.SecurityContext; psc != nil {
		uid, gid = psc.RunAsUser, psc.RunAsGroup
		if psc.FSGroup != nil {
			groups = append(groups, uint32(*psc.FSGroup))
		}
		for _, g := range psc.SupplementalGroups {
			groups = append(groups, uint32(g))
		}
	}
	if ctr != nil && ctr.SecurityContext != nil {
		if ctr.SecurityContext.RunAsUser != nil {
			uid = ctr.SecurityContext.RunAsUser
		}
		if ctr.SecurityContext.RunAsGroup != nil {
			gid = ctr.SecurityContext.RunAsGroup
		}
	}
	id := testenv.Identity{UID: img.uid, GID: img.gid}
	if uid != nil {
		id.UID, id.GID = uint32(*uid), 0
		if img.mapsUIDToGID {
			id.GID = uint32(*uid)
		}
	}
	if gid != nil {
		id.GID = uint32(*gid)
	}
	return id, groups
}

// userValue is a user annotation as the webhook resolves it: the pod's, else the namespace's.
func (c propertyCase) userValue(key string) string {
	if v, ok := c.pod.Annotations[key]; ok {
		return v
	}
	return c.ns[key]
}

// remoteSkipped reports whether the user's skip lists cover the remote server of the family.
func (c propertyCase) remoteSkipped(t *testing.T) bool {
	ports, err := annotations.ParsePorts(annotations.SkipOutboundPorts, c.userValue(annotations.SkipOutboundPorts))
	if err != nil {
		t.Fatal(err)
	}
	nets, err := annotations.ParseCIDRs(annotations.SkipOutboundCIDRs, c.userValue(annotations.SkipOutboundCIDRs))
	if err != nil {
		t.Fatal(err)
	}
	if slices.ContainsFunc(ports, func(p annotations.PortRange) bool { return p.First <= propertyRemote && propertyRemote <= p.Last }) {
		return true
	}
	remote := propertyRemoteIP4
	if c.family == iptables.IPv6 {
		remote = propertyRemoteIP6
	}
	return slices.ContainsFunc(nets, func(p netip.Prefix) bool { return p.Contains(remote) })
}

func TestIntegrationInjectProperty(t *testing.T) {
	testenv.Privileged(t)
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("DETOUR_PROPERTY_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("DETOUR_PROPERTY_SEED=%q: %v", s, err)
		}
	}
	pods := 250
	if s := os.Getenv("DETOUR_PROPERTY_PODS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("DETOUR_PROPERTY_PODS=%q: a positive number of pods", s)
		}
		pods = n
	}
	t.Logf("seed %d, %d pods (DETOUR_PROPERTY_SEED=%d reproduces this run)", seed, pods, seed)

	configs := map[string]*inject.Config{}
	for _, mode := range []string{"auto", "container", "native"} {
		cfg, err := inject.ParseConfig([]byte("proxy: {image: proxy:property}\nsidecarMode: " + mode))
		if err != nil {
			t.Fatal(err)
		}
		configs[mode] = cfg
	}

	// One pod namespace and one remote for every case: each case's rules replace the whole nat
	// table of its family.
	podNS, remoteNS := testenv.NewNetNS(t), testenv.NewNetNS(t)
	testenv.Link(t, podNS, "eth0", []netip.Prefix{netip.PrefixFrom(propertyPodIP4, 24), netip.PrefixFrom(propertyPodIP6, 64)},
		remoteNS, "eth0", []netip.Prefix{netip.PrefixFrom(propertyRemoteIP4, 24), netip.PrefixFrom(propertyRemoteIP6, 64)})
	// The sentinels are routed out of the pod, as in a real pod with a default route.
	testenv.AddRoute(t, podNS, netip.MustParsePrefix("203.0.113.0/24"), propertyRemoteIP4)
	testenv.AddRoute(t, podNS, netip.MustParsePrefix("2001:db8::/32"), propertyRemoteIP6)
	testenv.Serve(t, podNS, "proxy", "tcp4", fmt.Sprintf("0.0.0.0:%d", propertyProxyPort))
	testenv.Serve(t, podNS, "proxy", "tcp6", fmt.Sprintf("[::]:%d", propertyProxyPort))
	testenv.Serve(t, remoteNS, "remote", "tcp4", fmt.Sprintf("0.0.0.0:%d", propertyRemote))
	testenv.Serve(t, remoteNS, "remote", "tcp6", fmt.Sprintf("[::]:%d", propertyRemote))

	// The network is up before any property is checked: the first IPv6 connection over a
	// fresh veth can be lost while the link settles, which would fail whichever pod came first.
	for _, ip := range []netip.Addr{propertyRemoteIP4, propertyRemoteIP6} {
		addr := netip.AddrPortFrom(ip, propertyRemote)
		deadline := time.Now().Add(10 * time.Second)
		for {
			got, err := testenv.DialAs(podNS, testenv.Identity{}, nil, addr, time.Second)
			if err == nil && got == "remote "+addr.String() {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the test network does not carry %s: got %q (%v)", addr, got, err)
			}
		}
	}

	stats := map[string]int{}
	for i := range pods {
		r := rand.New(rand.NewPCG(seed, uint64(i)))
		c := randomCase(r)
		if !checkPropertyCase(t, podNS, c, configs[c.cfgMode], stats) {
			t.Fatalf("pod %d of seed %d failed (DETOUR_PROPERTY_SEED=%d reproduces it)", i, seed, seed)
		}
	}
	t.Logf("checked %d pods: %v", pods, stats)
}

// checkPropertyCase injects c's pod, loads its rules and checks every identity; it reports
// whether all held, logging the pod and its rules when one did not.
func checkPropertyCase(t *testing.T, ns *testenv.NetNS, c propertyCase, cfg *inject.Config, stats map[string]int) bool {
	t.Helper()
	pod := c.pod.DeepCopy()
	res, err := inject.Mutate(pod, inject.Input{NamespaceAnnotations: c.ns, NativeSidecars: c.native}, cfg)
	if err != nil {
		t.Errorf("Mutate: %v", err)
		return false
	}
	if res.Outcome != inject.Injected {
		t.Errorf("not injected: %s", res.Reason)
		return false
	}
	stats[string(res.Mode)]++
	var failures []string
	fail := func(format string, args ...any) { failures = append(failures, fmt.Sprintf(format, args...)) }

	doc, err := yaml.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	rules, _, err := run(t, string(doc), "rules", "-f", "-", "--family="+c.family.String())
	if err != nil {
		t.Errorf("detour rules: %v", err)
		return false
	}
	tool := "iptables-legacy-restore"
	if c.family == iptables.IPv6 {
		tool = "ip6tables-legacy-restore"
	}
	// Without --noflush: the rules replace the family's whole nat table.
	if err := ns.Do(func() error {
		_, err := iptables.ExecRunner{}.Run(context.Background(), tool, nil, []byte(rules))
		return err
	}); err != nil {
		t.Errorf("load the rules: %v", err)
		return false
	}

	redirect, err := annotations.ParseRedirect(pod.Annotations)
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(redirect.ExemptUIDs, 0) || slices.Contains(redirect.ExemptGIDs, 0) {
		fail("0 is exempt: uids %v gids %v", redirect.ExemptUIDs, redirect.ExemptGIDs)
	}

	remote, sentinel := netip.AddrPortFrom(propertyRemoteIP4, propertyRemote), netip.MustParseAddrPort("203.0.113.254:80")
	if c.family == iptables.IPv6 {
		remote, sentinel = netip.AddrPortFrom(propertyRemoteIP6, propertyRemote), netip.MustParseAddrPort("[2001:db8::fe]:80")
	}
	direct, captured := "remote "+remote.String(), "proxy "+remote.String()
	mustStay := captured
	if c.remoteSkipped(t) {
		mustStay = direct
		stats["remote-skipped"]++
	}
	expect := func(who string, id testenv.Identity, groups []uint32, addr netip.AddrPort, want string) {
		got, err := testenv.DialAs(ns, id, groups, addr, 2*time.Second)
		if err != nil || got != want {
			fail("%s (%s, groups %v) dialing %s: got %q (%v), want %q", who, id, groups, addr, got, err, want)
		}
	}

	// The validator passes whatever the skip lists say.
	v := pod.Spec.InitContainers[0]
	vid, vgroups := c.identity(pod, &v, imageUser{})
	expect("the validator", vid, vgroups, sentinel, "proxy "+sentinel.String())
	// The proxy goes out directly.
	proxy := pod.Spec.Containers[len(pod.Spec.Containers)-1]
	if res.Mode == annotations.SidecarNative {
		proxy = pod.Spec.InitContainers[1]
	}
	pid, pgroups := c.identity(pod, &proxy, imageUser{})
	expect("the proxy", pid, pgroups, remote, direct)
	// Root and the pod's default identity (a kubectl debug container) are captured.
	expect("root", testenv.Identity{}, nil, remote, mustStay)
	did, dgroups := c.identity(pod, nil, c.debugUser)
	expect("the pod's default identity (kubectl debug)", did, dgroups, remote, mustStay)

	decisions := map[string]inject.Decision{}
	for _, d := range res.Decisions {
		decisions[d.Container] = d
	}
	for i := range pod.Spec.InitContainers {
		ctr := &pod.Spec.InitContainers[i]
		img, user := c.images[ctr.Name]
		if !user {
			continue // detour's
		}
		id, groups := c.identity(pod, ctr, img)
		d := decisions[ctr.Name]
		switch {
		case d.Via == inject.Sidecar:
			stats["user-sidecar"]++
			expect(fmt.Sprintf("user sidecar %q", ctr.Name), id, groups, remote, mustStay)
		case d.Via == inject.ViaUID || d.Via == inject.ViaGID || d.Via == inject.ViaProxyUID:
			stats["init-egress-"+string(d.Via)]++
			expect(fmt.Sprintf("init container %q (%s %d)", ctr.Name, d.Via, d.ID), id, groups, remote, direct)
		case d.Via == inject.ViaProxy, d.Via == inject.NotSelected:
			stats["init-"+string(d.Via)]++
			expect(fmt.Sprintf("init container %q (%s)", ctr.Name, d.Via), id, groups, remote, mustStay)
		default:
			fail("init container %q: decision %+v; with the default GID range every selected init container must get egress", ctr.Name, d)
		}
	}
	for i := range pod.Spec.Containers {
		ctr := &pod.Spec.Containers[i]
		img, user := c.images[ctr.Name]
		if !user {
			continue
		}
		id, groups := c.identity(pod, ctr, img)
		expect(fmt.Sprintf("app container %q", ctr.Name), id, groups, remote, mustStay)
	}
	if len(failures) == 0 {
		return true
	}
	for _, f := range failures {
		t.Error(f)
	}
	images := map[string]string{}
	for name, img := range c.images {
		images[name] = fmt.Sprintf("uid %d gid %d maps-uid-to-gid %v", img.uid, img.gid, img.mapsUIDToGID)
	}
	t.Logf("namespace annotations %v, cluster native sidecars %v, sidecarMode %s, family %s, images %v\ninjected pod:\n%s\nwarnings: %q\nrules:\n%s",
		c.ns, c.native, c.cfgMode, c.family, images, doc, res.Warnings, rules)
	return false
}
