"""One real node in the lab (`python -m e2e.lab up --with kubelet`), beside kwok's fake GPU fleet.

    per node (pools.yaml's `runner: kubelet` pool: `lab-real-0`, `lab-real-1`), each in a mount
    namespace of its own (below):
    containerd (Debian's, runc)  -- its own root, state, socket and runc root under <lab>/node/<node>/
    kubelet                      -- registers the node, cgroupfs driver, pods under CGROUP_ROOT/<node>
    lab GPU plugin (gpuplugin/)  -- a device plugin: the pool's `nvidia.com/gpu` count, allocated by the kubelet
    shared by the nodes, in the host's namespaces:
    CNI bridge                   -- BRIDGE with GATEWAY on POD_CIDR (created here, deleted by `down`)
    kube-proxy (iptables mode)   -- Services, including `kubernetes` (10.96.0.1:443 -> GATEWAY:apiserver)
    CoreDNS                      -- on GATEWAY:53, the kubernetes plugin for cluster.local; the kubelet's clusterDNS

The API server listens on all addresses when a real node runs, so pods reach it at GATEWAY (a
non-loopback address in its certificate) and through the `kubernetes` Service.

What a node changes on the host, the lab records before (HostState.capture) and puts back at `down`
(restore): the kubelet's and the bridge plugin's sysctls (vm.overcommit_memory, kernel.panic,
kernel.panic_on_oops, ip_forward, ...), the iptables and ip6tables rules (kubelet, kube-proxy, CNI
masquerading; restored from iptables-save), the pod cgroups (CGROUP_ROOT in every hierarchy),
mounts (container root filesystems, /dev/shm, network namespaces), the bridge, and the directories a
kubelet creates outside its root. Pods are removed through the CRI first, so CNI deletes what it made.

Several kubelets on one host: a kubelet's device manager always listens on
/var/lib/kubelet/device-plugins/kubelet.sock (k8s.io/kubelet DevicePluginPath, whatever --root-dir says),
and its self-signed serving certificate goes to /var/lib/kubelet/pki. So each node's containerd,
kubelet and GPU plugin run in a mount namespace of the node's own (`unshare --mount`, kept by a bind
of its nsfs file under <lab>/node/mntns/), where /var/lib/kubelet is the node's own directory. The
three share that namespace because the kubelet mounts volumes (tmpfs for tokens, emptyDirs) that
containerd bind-mounts into containers; the mounts made there never reach the host's table, and go
with the namespace. Everything else a node needs is its own by path or port already.

Only one lab with real nodes runs on a machine at a time: the bridge, the cgroup root, CoreDNS's
address and the iptables chains are host-wide. `up --with kubelet` refuses to start when the bridge
already exists.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from . import nodes as lab_nodes
from . import pki as lab_pki
from .processes import LabStartError, free_ports, http_ok, wait_until

# The nodes are those of pools.yaml's `runner: kubelet` pool: their names, labels, taints and GPUs. Each
# reports this machine's CPUs and memory as its capacity (they share them, as the nodes of a test
# cluster on one host do).
POOL = lab_nodes.load_pools().kubelet_pool()
NODE_NAMES = tuple(POOL.node_names())
NODE_NAME = NODE_NAMES[0]
BRIDGE = "ftlab0"
POD_CIDR = "10.85.0.0/24"
GATEWAY = "10.85.0.1"
CLUSTER_DOMAIN = "cluster.local"
CGROUP_ROOT = "finetune-lab"
CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
PAUSE_IMAGE = "registry.k8s.io/pause:lab"
# The real node's label and taint: only pods that ask for it (a toleration) land there.
RUNNER_LABEL = lab_nodes.RUNNER_LABEL
RUNNER_KUBELET = lab_nodes.RUNNER_KUBELET
NODE_PORTS = ("kubelet", "kubelet-healthz")
SHARED_PORTS = ("kube-proxy-healthz", "kube-proxy-metrics")

KUBE_PROXY = lab_pki.ClientIdentity("kube-proxy", "system:kube-proxy", ("system:masters",))
COREDNS = lab_pki.ClientIdentity("coredns", "lab-coredns", ("system:masters",))
SHARED_IDENTITIES = (KUBE_PROXY, COREDNS)


def kubelet_identity(name: str) -> lab_pki.ClientIdentity:
    return lab_pki.ClientIdentity(f"kubelet-{name}", f"system:node:{name}", ("system:nodes", "system:masters"))

# What the kubelet (protectKernelDefaults: false), the bridge plugin and kube-proxy may set.
SYSCTLS = (
    "vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.ipv4.ip_forward",
    "net.ipv4.conf.all.route_localnet", "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
)
# Host paths a kubelet or containerd may create outside the directories the lab gives them.
HOST_PATHS = ("/usr/libexec/kubernetes", "/var/lib/kubelet", "/var/lib/cni", "/etc/cni", "/run/containerd",
              "/var/run/netns", "/var/log/pods", "/var/log/containers", "/etc/kubernetes", "/opt/cni")
CGROUP_FS = Path("/sys/fs/cgroup")
# The kubelet's device manager listens here whatever --root-dir says (k8s.io/kubelet DevicePluginPath);
# the lab GPU plugin puts its socket beside it. In each node's mount namespace, KUBELET_HOST_DIR is
# the node's own directory (NodePaths.var_lib_kubelet); on the host it is only the mount point,
# one of HOST_PATHS (down removes it when the host had none).
KUBELET_HOST_DIR = Path("/var/lib/kubelet")
DEVICE_PLUGIN_DIR = KUBELET_HOST_DIR / "device-plugins"


class RealNodeError(LabStartError):
    pass


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def _run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise RealNodeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def cgroup_hierarchies() -> list[Path]:
    """Each mounted hierarchy (cgroup v1: one per controller set; v2: the one root)."""
    if (CGROUP_FS / "cgroup.controllers").exists():
        return [CGROUP_FS]
    return sorted(p for p in CGROUP_FS.iterdir() if p.is_dir() and not p.is_symlink() and (p / "cgroup.procs").exists())


def _mount_points() -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]


def _links() -> list[str]:
    return sorted(line.split(":")[1].strip().split("@")[0] for line in _run(["ip", "-o", "link", "show"]).stdout.splitlines())


@dataclass
class HostState:
    """The host as it was before a real node started; `restore` puts it back."""

    sysctls: dict[str, str] = field(default_factory=dict)
    iptables: dict[str, str] = field(default_factory=dict)  # iptables-save / ip6tables-save output
    paths: list[str] = field(default_factory=list)  # of HOST_PATHS, those that existed
    mounts: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    cgroups: dict[str, list[str]] = field(default_factory=dict)  # hierarchy -> its top-level groups

    @classmethod
    def capture(cls) -> "HostState":
        return cls(
            sysctls={n: _sysctl_path(n).read_text().strip() for n in SYSCTLS if _sysctl_path(n).exists()},
            iptables={t: _run([f"{t}-save"]).stdout for t in ("iptables", "ip6tables") if shutil.which(f"{t}-save")},
            paths=[p for p in HOST_PATHS if os.path.lexists(p)],
            mounts=_mount_points(),
            links=_links(),
            cgroups={str(h): sorted(d.name for d in h.iterdir() if d.is_dir()) for h in cgroup_hierarchies()},
        )

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "HostState":
        return cls(**json.loads(path.read_text()))

    def differences(self, now: "HostState") -> list[str]:
        """What differs between this (before) and `now`, in words; [] when the host is as it was."""
        out = []
        for name, value in self.sysctls.items():
            if now.sysctls.get(name) != value:
                out.append(f"sysctl {name}: {value} before, {now.sysctls.get(name)} now")
        for table, saved in self.iptables.items():
            if _rules(saved) != _rules(now.iptables.get(table, "")):
                extra = sorted(_rules(now.iptables.get(table, "")) - _rules(saved))[:5]
                gone = sorted(_rules(saved) - _rules(now.iptables.get(table, "")))[:5]
                out.append(f"{table}: added {extra}, removed {gone}")
        for p in sorted(set(now.paths) - set(self.paths)):
            out.append(f"path {p} was created")
        for m in sorted(set(now.mounts) - set(self.mounts)):
            out.append(f"mount {m} is left")
        for link in sorted(set(now.links) - set(self.links)):
            out.append(f"network link {link} is left")
        for h, groups in now.cgroups.items():
            for g in sorted(set(groups) - set(self.cgroups.get(h, []))):
                out.append(f"cgroup {h}/{g} is left")
        return out


BUILTIN_CHAINS = {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"}


def _tables(saved: str) -> set[str]:
    return {line[1:] for line in saved.splitlines() if line.startswith("*")}


def _rules(saved: str) -> set[str]:
    """iptables-save's rules and chains, without its comments and packet counters. An empty table (built-in
    chains that accept, no rules) filters nothing: it counts as no table."""
    out = set()
    for line in saved.splitlines():
        if line.startswith(("#", "*")) or line == "COMMIT":
            continue
        if line.startswith(":"):
            name, policy = line[1:].split()[:2]  # ":CHAIN POLICY [pkts:bytes]"
            if name in BUILTIN_CHAINS and policy == "ACCEPT":
                continue
            line = f":{name} {policy}"
        out.add(line)
    return out


# ---- configuration files ---------------------------------------------------------------------------

def nodes_root(workdir: Path) -> Path:
    """<lab>/node: the nodes' directories, the shared configuration and the host's record."""
    return workdir / "node"


def node_paths(workdir: Path, name: str) -> "NodePaths":
    return NodePaths(nodes_root(workdir) / name)


def host_state_file(workdir: Path) -> Path:
    return nodes_root(workdir) / "host-state.json"


@dataclass(frozen=True)
class NodePaths:
    root: Path  # <lab>/node/<node name>

    @property
    def containerd(self) -> Path:
        return self.root / "containerd"

    @property
    def socket(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    @property
    def kubelet(self) -> Path:
        return self.root / "kubelet"

    @property
    def cni_conf(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def base_spec(self) -> Path:
        return self.containerd / "base-spec.json"

    @property
    def var_lib_kubelet(self) -> Path:
        """What /var/lib/kubelet is inside the node's mount namespace."""
        return self.root / "var-lib-kubelet"


def mount_namespace(workdir: Path, name: str) -> Path:
    """The nsfs file that keeps node `name`'s mount namespace."""
    return nodes_root(workdir) / "mntns" / name


def in_node(workdir: Path, name: str, argv: list[str]) -> list[str]:
    """`argv` run inside node `name`'s mount namespace (nsenter execs it: the pid stays the program's)."""
    return ["nsenter", f"--mount={mount_namespace(workdir, name)}", "--", *argv]


def make_mount_namespace(workdir: Path, name: str) -> None:
    """Node `name`'s mount namespace: a copy of the host's that receives the host's later mounts
    (slave) and gives none back, with /var/lib/kubelet bound to the node's own directory. Kept alive by
    a bind of its nsfs file, which must sit on a private mount (the namespace would otherwise see the
    bind of itself); restore_host unmounts both."""
    holder = mount_namespace(workdir, name).parent
    holder.mkdir(parents=True, exist_ok=True)
    if str(holder) not in _mount_points():
        _run(["mount", "--bind", str(holder), str(holder)])
        _run(["mount", "--make-private", str(holder)])
    ns = mount_namespace(workdir, name)
    ns.touch()
    _run(["unshare", f"--mount={ns}", "--propagation", "slave", "true"])
    own = node_paths(workdir, name).var_lib_kubelet
    own.mkdir(parents=True, exist_ok=True)
    KUBELET_HOST_DIR.mkdir(parents=True, exist_ok=True)
    _run(in_node(workdir, name, ["mount", "--bind", str(own), str(KUBELET_HOST_DIR)]))



def containerd_config(paths: NodePaths) -> str:
    c = paths.containerd
    return f"""version = 2
root = "{c / 'root'}"
state = "{c / 'state'}"
# Not the host's plugins and directories: everything under the lab's directory.
plugin_dir = ""
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{paths.socket}"

[ttrpc]
  address = "{paths.socket}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{c / 'opt'}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # Root here lacks CAP_SYS_RESOURCE: a sandbox's oom_score_adj of -998 would fail every pod start.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # Network namespaces under the state directory, not /var/run/netns.
  netns_mounts_under_state_dir = true

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      # Every container starts from this OCI spec: containerd's own default plus the host's Python,
      # read-only at its own path (base_spec below). Only the lab's trainer image uses it.
      base_runtime_spec = "{paths.base_spec}"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # crun fails on this host (cgroups in hybrid mode); runc works.
        BinaryName = "{shutil.which('runc') or '/usr/sbin/runc'}"
        Root = "{c / 'runc'}"
        SystemdCgroup = false

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{paths.cni_conf}"
"""


def base_spec(default_spec: dict, host_python: Sequence[Path]) -> dict:
    """containerd's default OCI spec (`ctr oci spec`) plus read-only bind mounts: the host's Python
    (its installation and any virtual environment the lab runs in: images.host_python_paths) at its own path. The lab trainer image's /opt/venv runs on it (e2e/lab/images.py: the PyPI torch
    is a CUDA build of several GB, too much to build into an image here), as NVIDIA's container
    toolkit mounts the driver's libraries into every GPU container. The pod specs stay exactly as the
    operator renders them (no hostPath volume, which the restricted Pod Security Standard refuses)."""
    spec = json.loads(json.dumps(default_spec))
    for path in host_python:
        target = str(path)
        if any(m.get("destination") == target for m in spec.get("mounts", [])):
            raise RealNodeError(f"containerd's default spec already mounts {target}")
        spec.setdefault("mounts", []).append({"destination": target, "type": "bind", "source": target,
                                              "options": ["rbind", "ro", "nosuid", "nodev"]})
    return spec


def cni_config(ipam_dir: Path) -> dict:
    """One bridge network for every node's pods: one subnet, one host-local allocation directory
    (its file lock keeps two containerds from handing out the same address)."""
    return {
        "cniVersion": "1.0.0",
        "name": "finetune-lab",
        "plugins": [{
            "type": "bridge",
            "bridge": BRIDGE,
            "isGateway": True,
            "ipMasq": True,
            # A pod that reaches itself through a Service: the packet comes back on its own port.
            "hairpinMode": True,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": POD_CIDR, "gateway": GATEWAY}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": str(ipam_dir),
            },
        }],
    }


def kubelet_config(paths: NodePaths, ports: dict[str, int], name: str = NODE_NAME) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": GATEWAY,
        "port": ports["kubelet"],
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": ports["kubelet-healthz"],
        # The API server calls the kubelet (logs, exec) without a client certificate, as it calls kwok.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_ROOT}/{name}",
        # The host is cgroup v1 (hybrid); kubelet 1.35+ refuses it unless told.
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": paths.endpoint,
        "clusterDNS": [GATEWAY],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "/etc/resolv.conf",
        "volumePluginDir": str(paths.kubelet / "volume-plugins"),
        "podLogsDir": str(paths.root / "pod-logs"),
        "protectKernelDefaults": False,
        "serializeImagePulls": False,
        "maxPods": 32,
        # A shared disk in a busy VM: evict only when really out of room.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2%", "imagefs.available": "2%",
                         "nodefs.inodesFree": "2%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "nodeStatusReportFrequency": "10s",
        "registerWithTaints": lab_nodes.node_taints(POOL),
    }


def kube_proxy_config(kubeconfig: Path, ports: dict[str, int]) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        # One kube-proxy serves every node: they share the host's network namespace and iptables.
        "hostnameOverride": NODE_NAME,
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "healthzBindAddress": f"127.0.0.1:{ports['kube-proxy-healthz']}",
        "metricsBindAddress": f"127.0.0.1:{ports['kube-proxy-metrics']}",
        # No conntrack sysctls (0 = leave the host's), no route_localnet for NodePorts on 127.0.0.1.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": {"masqueradeAll": True, "localhostNodePorts": False},
        "nodePortAddresses": [f"{GATEWAY}/32"],
    }


def corefile(kubeconfig: Path) -> str:
    return f""".:53 {{
    bind {GATEWAY}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} finetune-lab
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    forward . /etc/resolv.conf
    cache 5
}}
"""


# ---- start and stop ---------------------------------------------------------------------------------

def _bridge_exists() -> bool:
    return _run(["ip", "link", "show", BRIDGE], check=False).returncode == 0


def prepare_host(workdir: Path) -> HostState:
    """Record the host, then make what the nodes need before their processes: the bridge with GATEWAY
    (CoreDNS and the API server's address live there before any pod) and the pod cgroup roots."""
    if _bridge_exists():
        raise RealNodeError(f"bridge {BRIDGE} exists: another real node runs on this machine (or a lab was not"
                            " stopped); stop it with `python -m e2e.lab down` first")
    if (DEVICE_PLUGIN_DIR / "kubelet.sock").exists():
        raise RealNodeError(f"{DEVICE_PLUGIN_DIR / 'kubelet.sock'} exists: a kubelet already runs on this machine"
                            " (its kube-proxy chains and cgroups would meet the lab's); the lab's real nodes cannot"
                            " start beside it")
    nodes_root(workdir).mkdir(parents=True, exist_ok=True)
    state = HostState.capture()
    state.save(host_state_file(workdir))
    _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    _run(["ip", "addr", "add", f"{GATEWAY}/{POD_CIDR.split('/')[1]}", "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])
    for h in cgroup_hierarchies():
        for group in (h / CGROUP_ROOT, *(h / CGROUP_ROOT / name for name in NODE_NAMES)):
            group.mkdir(exist_ok=True)
            # cgroup v1 cpuset: a new group has no CPUs or memory nodes, and nothing can join it until it does.
            for f in ("cpuset.cpus", "cpuset.mems"):
                if (group.parent / f).exists() and not (group / f).read_text().strip():
                    (group / f).write_text((group.parent / f).read_text())
    for name in NODE_NAMES:
        make_mount_namespace(workdir, name)
    return state


def _client_kubeconfig(lab, pki, ident: lab_pki.ClientIdentity, path: Path) -> Path:
    from .cluster import write_kubeconfig

    pair = lab_pki.make_leaf(lab.pki_dir, pki.ca, ident.file_stem, ident.common_name, ident.organizations, client=True)
    return write_kubeconfig(path, lab.server, lab.pki_dir / "ca.crt",
                            {"client-certificate": str(pair.cert), "client-key": str(pair.key)})


def write_shared_configs(lab, pki, ports: dict[str, int]) -> dict[str, Path]:
    """kube-proxy's and CoreDNS's configuration (one of each for all nodes)."""
    root = nodes_root(lab.workdir)
    kubeconfigs = {i.file_stem: _client_kubeconfig(lab, pki, i, root / f"{i.file_stem}.kubeconfig")
                   for i in SHARED_IDENTITIES}
    files = {"kube-proxy": root / "kube-proxy.yaml", "corefile": root / "Corefile"}
    files["kube-proxy"].write_text(yaml.safe_dump(kube_proxy_config(kubeconfigs["kube-proxy"], ports), sort_keys=False))
    files["corefile"].write_text(corefile(kubeconfigs["coredns"]))
    return files


def write_node_configs(lab, name: str, pki, ports: dict[str, int]) -> dict[str, Path]:
    """One node's containerd (with its base spec), CNI and kubelet configuration and kubeconfig."""
    from .images import host_python_paths

    paths = node_paths(lab.workdir, name)
    for d in (paths.containerd, paths.kubelet, paths.cni_conf, paths.root / "pod-logs"):
        d.mkdir(parents=True, exist_ok=True)
    files = {"containerd": paths.root / "containerd.toml", "kubelet": paths.root / "kubelet.yaml",
             "kubelet.kubeconfig": _client_kubeconfig(lab, pki, kubelet_identity(name), paths.root / "kubelet.kubeconfig")}
    files["containerd"].write_text(containerd_config(paths))
    default = json.loads(_run(["ctr", "oci", "spec"]).stdout)
    paths.base_spec.write_text(json.dumps(base_spec(default, host_python_paths()), indent=2) + "\n")
    ipam = nodes_root(lab.workdir) / "cni-ipam"
    (paths.cni_conf / "10-finetune-lab.conflist").write_text(json.dumps(cni_config(ipam), indent=2) + "\n")
    files["kubelet"].write_text(yaml.safe_dump(kubelet_config(paths, ports, name), sort_keys=False))
    return files


def import_image(paths: NodePaths, archive: Path) -> None:
    """`ctr images import`: the archive's index names the image (e2e/lab/images.py), nothing is pulled."""
    _run(["ctr", "--address", str(paths.socket), "-n", "k8s.io", "images", "import", "--all-platforms", str(archive)],
         timeout=600)


def start(lab, node_inst, pki, launch, say, images: list[Path]) -> None:
    """Start the nodes' processes (launch = lab.spawn); returns when every node is Ready with its GPUs."""
    from kubernetes import client

    shared_ports = free_ports(list(SHARED_PORTS))
    node_ports = {name: free_ports(list(NODE_PORTS)) for name in NODE_NAMES}
    lab.ports.update({f"node-{k}": v for k, v in shared_ports.items()})
    lab.ports.update({f"{name}-{k}": v for name, ports in node_ports.items() for k, v in ports.items()})
    lab.save()
    prepare_host(lab.workdir)
    shared = write_shared_configs(lab, pki, shared_ports)
    node_files = {name: write_node_configs(lab, name, pki, ports) for name, ports in node_ports.items()}
    containerds = {name: launch(f"containerd-{name}", in_node(lab.workdir, name, [
        "containerd", f"--config={node_files[name]['containerd']}", "--log-level=warn"])) for name in NODE_NAMES}

    def load_images(name: str) -> None:
        paths = node_paths(lab.workdir, name)
        wait_until(f"{name}'s containerd socket", lambda: paths.socket.exists(), containerds[name], 60)
        for archive in images:
            import_image(paths, archive)
        say(f"{name}: containerd ready; imported {', '.join(a.parent.name for a in images)}")

    # Each node's containerd unpacks its own copy of the images: the nodes at once, not one after the other.
    with ThreadPoolExecutor(max_workers=len(NODE_NAMES)) as pool:
        for done in [pool.submit(load_images, name) for name in NODE_NAMES]:
            done.result()
    launch("coredns", [node_inst.binary("coredns"), "-conf", str(shared["corefile"]), "-dns.port", "53"])
    launch("kube-proxy", [node_inst.binary("kube-proxy"), f"--config={shared['kube-proxy']}"])
    kubelets = {}
    for index, name in enumerate(NODE_NAMES):
        paths = node_paths(lab.workdir, name)
        kubelets[name] = launch(f"kubelet-{name}", in_node(lab.workdir, name, [
            node_inst.binary("kubelet"),
            f"--config={node_files[name]['kubelet']}",
            f"--kubeconfig={node_files[name]['kubelet.kubeconfig']}",
            f"--root-dir={paths.kubelet}",
            f"--node-ip={GATEWAY}",
            f"--hostname-override={name}",
            "--node-labels=" + ",".join(f"{k}={v}" for k, v in lab_nodes.node_labels(POOL, index).items()),
            "--v=1",
        ]))
    core = client.CoreV1Api(lab.api_client())
    gpus = POOL.gpu.count if POOL.gpu else 0
    for name in NODE_NAMES:
        def ready(name: str = name) -> bool:
            node = core.read_node(name)
            return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

        wait_until(f"node {name} Ready (kubelet, containerd, CNI)", ready, kubelets[name], 180)
        if not gpus:
            continue
        plugin = launch(f"lab-gpu-plugin-{name}", in_node(lab.workdir, name, [
            node_inst.binary("lab-gpu-plugin"), "-dir", str(DEVICE_PLUGIN_DIR), "-count", str(gpus)]))

        def advertised(name: str = name) -> bool:
            allocatable = core.read_node(name).status.allocatable or {}
            return allocatable.get(lab_nodes.GPU_RESOURCE) == str(gpus)

        wait_until(f"{gpus} x {lab_nodes.GPU_RESOURCE} allocatable on {name} (the lab GPU plugin)", advertised, plugin, 60)
    wait_until("kube-proxy /healthz",
               lambda: http_ok(f"http://127.0.0.1:{shared_ports['kube-proxy-healthz']}/healthz"), None, 60)
    say(f"real nodes {', '.join(NODE_NAMES)} ready")


def kubernetes_endpoints(apiserver_port: int) -> dict:
    """The `kubernetes` Service's EndpointSlice (the lab's API server has no endpoint reconciler): GATEWAY."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "kubernetes", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "kubernetes",
                                "endpointslice.kubernetes.io/managed-by": "lab.finetune.dev"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [GATEWAY], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": apiserver_port, "protocol": "TCP"}],
    }


def _crictl(node_inst, paths: NodePaths, *args: str) -> subprocess.CompletedProcess:
    return _run([node_inst.binary("crictl"), f"--runtime-endpoint={paths.endpoint}", f"--image-endpoint={paths.endpoint}",
                 "--timeout=30s", *args], check=False, timeout=120)


def remove_pods(lab, node_home: Path | None) -> None:
    """Before the containerds stop: every pod sandbox stopped and removed through the CRI, so CNI
    deletes its addresses, masquerade rules and network namespaces."""
    from .build import Installation

    if node_home is None:
        return
    for name in NODE_NAMES:
        paths = node_paths(lab.workdir, name)
        if paths.socket.exists():
            _crictl(Installation(node_home), paths, "rmp", "--all", "--force")


def _shim_pids(root: Path) -> list[int]:
    """containerd-shim-runc-v2 processes of the nodes' containerds under `root` (they outlive them by design)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and str(root).encode() in b" ".join(argv):
            out.append(int(proc.name))
    return out


def restore_host(workdir: Path) -> list[str]:
    """After the node's processes stopped: put the host back as HostState recorded it. Returns what could
    not be put back (empty when all is well)."""
    import signal

    if not host_state_file(workdir).exists():
        return []
    before = HostState.load(host_state_file(workdir))
    problems = []
    for pid in _shim_pids(nodes_root(workdir)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # Mounts under the node's directories (container root filesystems, shm, tokens), deepest first.
    ours = (str(workdir), "/run/netns", "/var/run/netns", "/run/containerd", "/var/lib/kubelet")
    for m in sorted((m for m in set(_mount_points()) - set(before.mounts) if m.startswith(ours)), key=len, reverse=True):
        if _run(["umount", "-l", m], check=False).returncode != 0:
            problems.append(f"could not unmount {m}")
    netns = Path("/var/run/netns")
    if netns.is_dir() and "/var/run/netns" not in before.paths and "/run/netns" not in before.paths:
        for ns in netns.iterdir():
            _run(["umount", str(ns)], check=False)
            ns.unlink(missing_ok=True)
    if _bridge_exists():
        _run(["ip", "link", "delete", BRIDGE], check=False)
    for link in sorted(set(_links()) - set(before.links)):
        _run(["ip", "link", "delete", link], check=False)  # a pod's veth left by a killed shim
    for tool, saved in before.iptables.items():
        # iptables-restore replaces only the tables it is given: the ones the node brought (nat, mangle,
        # ... on a host that had none) are given empty, which drops their rules and chains; with the
        # nf_tables backend the then empty tables themselves are deleted too.
        brought = sorted(_tables(_run([f"{tool}-save"]).stdout) - _tables(saved))
        proc = subprocess.run([f"{tool}-restore"], input=saved + "".join(f"*{t}\nCOMMIT\n" for t in brought),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            problems.append(f"{tool}-restore failed: {proc.stderr.strip()}")
        if shutil.which("nft") and "nf_tables" in _run([tool, "--version"]).stdout:
            for t in brought:
                _run(["nft", "delete", "table", "ip" if tool == "iptables" else "ip6", t], check=False)
    for name, value in before.sysctls.items():
        try:
            if _sysctl_path(name).read_text().strip() != value:
                _sysctl_path(name).write_text(value + "\n")
        except OSError as exc:
            problems.append(f"sysctl {name}: {exc}")
    for h in cgroup_hierarchies():
        for g in sorted(set(d.name for d in h.iterdir() if d.is_dir()) - set(before.cgroups.get(str(h), []))):
            problems += _remove_cgroup(h / g)
    for p in HOST_PATHS:
        if os.path.lexists(p) and p not in before.paths:
            shutil.rmtree(p, ignore_errors=True)
    now = HostState.capture()
    return problems + before.differences(now)


def _remove_cgroup(top: Path) -> list[str]:
    """rmdir a cgroup tree deepest first; a group with tasks left gets them killed first (a shim's)."""
    import signal

    problems = []
    for d in sorted((p for p in [top, *top.rglob("*")] if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        for attempt in range(50):
            try:
                d.rmdir()
                break
            except OSError:
                for pid in (d / "cgroup.procs").read_text().split() if (d / "cgroup.procs").exists() else []:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                time.sleep(0.1)
        else:
            problems.append(f"could not remove cgroup {d}")
    return problems
