package main

// Volumes as per-pod host directories: emptyDir, secret, configMap, downwardAPI, projected
// (service-account tokens bound to the pod) and hostPath, with file modes and fsGroup ownership
// as the kubelet writes them.

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// writeFileMode writes a volume file with exactly the mode the pod asks for (items[].mode,
// else the volume's defaultMode, else 0644), past the umask, as the kubelet's atomic writer
// does; the new content replaces the old by rename.
func writeFileMode(path string, data []byte, mode *int32, def *int32) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	perm := os.FileMode(0o644)
	if def != nil {
		perm = os.FileMode(*def)
	}
	if mode != nil {
		perm = os.FileMode(*mode)
	}
	perm &= os.ModePerm
	tmp := path + ".tmp"
	_ = os.Remove(tmp) // a leftover read-only one could not be opened for writing
	if err := os.WriteFile(tmp, data, perm); err != nil {
		return err
	}
	if err := os.Chmod(tmp, perm); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// Masks the kubelet adds for the pod's fsGroup (SetVolumeOwnership): group read for
// read-only volumes (secret, configMap, downwardAPI, projected), group read-write for
// emptyDir; directories also get setgid and group search.
const (
	fsGroupROMask   = os.FileMode(0o440)
	fsGroupRWMask   = os.FileMode(0o660)
	fsGroupExecMask = os.FileMode(0o110)
)

// applyFSGroup gives every file and directory of a volume the pod's fsGroup as its group and
// the group permissions the kubelet adds. The agent can give a file a group it is not in only
// when it runs as root; otherwise the group stays the agent's own and only the modes apply
// (README, "Limitations").
func applyFSGroup(dir string, gid int64, readOnly bool) error {
	mask := fsGroupRWMask
	if readOnly {
		mask = fsGroupROMask
	}
	chown := os.Geteuid() == 0
	return filepath.Walk(dir, func(path string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if chown {
			if err := os.Lchown(path, -1, int(gid)); err != nil {
				return fmt.Errorf("fsGroup %d on %s: %w", gid, path, err)
			}
		}
		if info.Mode()&os.ModeSymlink != 0 {
			return nil
		}
		m := info.Mode().Perm() | mask
		if info.IsDir() {
			m |= os.ModeSetgid | fsGroupExecMask
		}
		return os.Chmod(path, m)
	})
}

func (w *podWorker) writeKeys(dir string, data map[string][]byte, items []corev1.KeyToPath, def *int32, optional bool, what string) error {
	if items == nil {
		for k, v := range data {
			if err := writeFileMode(filepath.Join(dir, k), v, nil, def); err != nil {
				return err
			}
		}
		return nil
	}
	for _, it := range items {
		v, ok := data[it.Key]
		if !ok {
			if optional {
				continue
			}
			return fmt.Errorf("%s has no key %q", what, it.Key)
		}
		if err := writeFileMode(filepath.Join(dir, it.Path), v, it.Mode, def); err != nil {
			return err
		}
	}
	return nil
}

func (w *podWorker) secretData(name string, optional bool) (map[string][]byte, error) {
	s, err := w.getSecret(w.pod.Namespace, name)
	if err != nil {
		if apierrors.IsNotFound(err) && optional {
			return map[string][]byte{}, nil
		}
		return nil, fmt.Errorf("secret %q: %w", name, err)
	}
	return s.Data, nil
}

func (w *podWorker) configMapData(name string, optional bool) (map[string][]byte, error) {
	cm, err := w.getConfigMap(w.pod.Namespace, name)
	if err != nil {
		if apierrors.IsNotFound(err) && optional {
			return map[string][]byte{}, nil
		}
		return nil, fmt.Errorf("configmap %q: %w", name, err)
	}
	data := map[string][]byte{}
	for k, v := range cm.Data {
		data[k] = []byte(v)
	}
	for k, v := range cm.BinaryData {
		data[k] = v
	}
	return data, nil
}

func (w *podWorker) downward(dir string, items []corev1.DownwardAPIVolumeFile, def *int32, spec corev1.Container) error {
	for _, it := range items {
		var v string
		switch {
		case it.FieldRef != nil:
			s, err := w.fieldValue(it.FieldRef.FieldPath)
			if err != nil {
				return err
			}
			v = s
		case it.ResourceFieldRef != nil:
			v = w.resourceValue(spec, it.ResourceFieldRef)
		}
		if err := writeFileMode(filepath.Join(dir, it.Path), []byte(v), it.Mode, def); err != nil {
			return err
		}
	}
	return nil
}

// memoryRoot holds the memory-backed emptyDirs (medium: Memory) of every pod on this machine:
// the host's tmpfs, so their pages are memory as on a kubelet (which mounts a tmpfs per
// volume). sizeLimit is not enforced here (README, "Limitations").
const memoryRoot = "/dev/shm/localcluster"

// memoryDir is where a pod's memory-backed emptyDirs live: under memoryRoot by pod UID (a pod
// UID is unique across clusters); empty when the host has no writable /dev/shm, and then the
// volume is an ordinary directory beside the others (logged).
func (w *podWorker) memoryDir() string {
	dir := filepath.Join(memoryRoot, string(w.uid))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		w.logf("no tmpfs for medium: Memory (%v): the emptyDir is on disk", err)
		return ""
	}
	return dir
}

// dropMemoryVolumes frees the pod's memory-backed emptyDirs: when the pod is gone, and when
// its node dies (a machine's memory does not outlive it; the pod's other files stay for
// post-mortems).
func (w *podWorker) dropMemoryVolumes() {
	_ = os.RemoveAll(filepath.Join(memoryRoot, string(w.uid)))
}

func (w *podWorker) setup() error {
	if err := os.MkdirAll(filepath.Join(w.dir, "volumes"), 0o755); err != nil {
		return err
	}
	return w.setupVolumes(false)
}

// setupVolumes materialises each volume as a host directory; with tokensOnly it refreshes
// the projected service-account tokens alone.
func (w *podWorker) setupVolumes(tokensOnly bool) error {
	p := w.pod
	optional := func(b *bool) bool { return b != nil && *b }
	var first corev1.Container
	if len(p.Spec.Containers) > 0 {
		first = p.Spec.Containers[0]
	}
	for _, v := range p.Spec.Volumes {
		dir := filepath.Join(w.dir, "volumes", v.Name)
		if !tokensOnly {
			w.volDirs[v.Name] = dir
		}
		vs := v.VolumeSource
		if tokensOnly && vs.Projected == nil {
			continue
		}
		if vs.EmptyDir != nil && vs.EmptyDir.Medium == corev1.StorageMediumMemory {
			if mem := w.memoryDir(); mem != "" {
				dir = filepath.Join(mem, v.Name)
				w.volDirs[v.Name] = dir
			}
		}
		switch {
		case vs.HostPath != nil:
			w.volDirs[v.Name] = vs.HostPath.Path
			if vs.HostPath.Type != nil && *vs.HostPath.Type == corev1.HostPathDirectoryOrCreate {
				if err := os.MkdirAll(vs.HostPath.Path, 0o755); err != nil {
					return err
				}
			}
			continue
		case vs.Secret != nil:
			data, err := w.secretData(vs.Secret.SecretName, optional(vs.Secret.Optional))
			if err != nil {
				return err
			}
			if err := w.writeKeys(dir, data, vs.Secret.Items, vs.Secret.DefaultMode, optional(vs.Secret.Optional), "secret "+vs.Secret.SecretName); err != nil {
				return err
			}
		case vs.ConfigMap != nil:
			data, err := w.configMapData(vs.ConfigMap.Name, optional(vs.ConfigMap.Optional))
			if err != nil {
				return err
			}
			if err := w.writeKeys(dir, data, vs.ConfigMap.Items, vs.ConfigMap.DefaultMode, optional(vs.ConfigMap.Optional), "configmap "+vs.ConfigMap.Name); err != nil {
				return err
			}
		case vs.DownwardAPI != nil:
			if err := w.downward(dir, vs.DownwardAPI.Items, vs.DownwardAPI.DefaultMode, first); err != nil {
				return err
			}
		case vs.Projected != nil:
			if err := w.setupProjected(v.Name, dir, vs.Projected, tokensOnly, first); err != nil {
				return err
			}
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if sc := p.Spec.SecurityContext; sc != nil && sc.FSGroup != nil {
			var err error
			switch {
			case vs.EmptyDir != nil:
				err = applyFSGroup(dir, *sc.FSGroup, false)
			case vs.Secret != nil, vs.ConfigMap != nil, vs.DownwardAPI != nil, vs.Projected != nil:
				err = applyFSGroup(dir, *sc.FSGroup, true)
			}
			if err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *podWorker) setupProjected(name, dir string, proj *corev1.ProjectedVolumeSource, tokensOnly bool, first corev1.Container) error {
	p := w.pod
	optional := func(b *bool) bool { return b != nil && *b }
	for _, src := range proj.Sources {
		switch {
		case src.ServiceAccountToken != nil:
			sat := src.ServiceAccountToken
			exp := int64(3607)
			if sat.ExpirationSeconds != nil {
				exp = *sat.ExpirationSeconds
			}
			var aud []string
			if sat.Audience != "" {
				aud = []string{sat.Audience}
			}
			sa := p.Spec.ServiceAccountName
			if sa == "" {
				sa = "default"
			}
			// Bound to the pod, as the kubelet requests it; the Node authorizer allows
			// exactly this for pods on this node.
			tr, err := w.a.client.CoreV1().ServiceAccounts(p.Namespace).CreateToken(w.a.ctx, sa, &authenticationv1.TokenRequest{
				Spec: authenticationv1.TokenRequestSpec{
					Audiences: aud, ExpirationSeconds: &exp,
					BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: p.Name, UID: p.UID},
				},
			}, metav1.CreateOptions{})
			if err != nil {
				return fmt.Errorf("service account token for %q: %w", sa, err)
			}
			tokenPath := filepath.Join(dir, sat.Path)
			if err := writeFileMode(tokenPath, []byte(tr.Status.Token), nil, proj.DefaultMode); err != nil {
				return err
			}
			ttl := time.Until(tr.Status.ExpirationTimestamp.Time)
			w.tokenAt = time.Now().Add(ttl * 8 / 10)
			if sat.Audience == "" && !tokensOnly {
				// A kubeconfig that logs in as the pod's ServiceAccount, since processes
				// cannot see the in-cluster paths under /var/run/secrets.
				kdir := filepath.Join(w.dir, "kubeconfigs")
				if err := os.MkdirAll(kdir, 0o755); err != nil {
					return err
				}
				kc := filepath.Join(kdir, name+".kubeconfig")
				if err := os.WriteFile(kc, kubeconfig(w.a.c.apiURL, w.a.c.ca.certPEM, nil, nil, tokenPath, p.Namespace), 0o600); err != nil {
					return err
				}
				w.kubeconfigs[name] = kc
			}
		case tokensOnly:
			continue
		case src.ConfigMap != nil:
			data, err := w.configMapData(src.ConfigMap.Name, optional(src.ConfigMap.Optional))
			if err != nil {
				return err
			}
			if err := w.writeKeys(dir, data, src.ConfigMap.Items, proj.DefaultMode, optional(src.ConfigMap.Optional), "configmap "+src.ConfigMap.Name); err != nil {
				return err
			}
		case src.Secret != nil:
			data, err := w.secretData(src.Secret.Name, optional(src.Secret.Optional))
			if err != nil {
				return err
			}
			if err := w.writeKeys(dir, data, src.Secret.Items, proj.DefaultMode, optional(src.Secret.Optional), "secret "+src.Secret.Name); err != nil {
				return err
			}
		case src.DownwardAPI != nil:
			if err := w.downward(dir, src.DownwardAPI.Items, proj.DefaultMode, first); err != nil {
				return err
			}
		}
	}
	return nil
}
