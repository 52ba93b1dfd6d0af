"""A deployment's environment, read and judged: what SGLang on Mooncake would do with it, and
which known traps it falls into. The other half of export_env.

Input is text: a dotenv file, the output of ``env``, or a Kubernetes manifest (Pod,
Deployment, StatefulSet, DaemonSet, ReplicaSet, Job, CronJob, LeaderWorkerSet, a ``List``,
several documents in one file). Each SGLang container becomes one :class:`Environment`.
:func:`judge` maps it to the profile it implies (:func:`orchestrator.preflight.serving.profile_from_env`,
the reverse of ``serving_env``), plans that profile with the rule book
(:func:`orchestrator.job.check.check_profile`) for the machine a deployment runs on (GPUs, a CUDA
Mooncake build, an RDMA device), and names each trap as a FAIL or WARN :class:`Finding`
that names the variable and the fix. :func:`cross_check` compares a prefill's environment
with a decode's (pool, aux layout switches, transport, PID namespace).

No I/O here beyond composing profiles: the doctor CLI reads the files and probes the
installed Mooncake wheel, and passes what it found in as :class:`Wheel`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping, Optional, Sequence

from orchestrator.job.check import check_profile
from orchestrator.preflight.compose import ProfileError
from orchestrator.preflight.serving import (
    NEW_POOL_VAR,
    POOL_VAR,
    PROTOCOL_VAR,
    SAMPLING_MASK_VAR,
    SEND_AUX_TCP_VAR,
    SGLANG_POOLS,
    TIMEOUT_VAR,
    profile_from_env,
    sglang_bool,
)
from orchestrator.profile.address import HOST_IP_VARS, NIC_VAR, Host, advertise
from orchestrator.profile.address import judge as address_judge
from orchestrator.profile.config import ConfigError, EndpointsConfig, MemPoolType, OrchestratorConfig
from orchestrator.profile.plan import (
    ALLOC_CONF_VARS,
    OFF_LOOKING,
    EngineTransport,
    Plan,
    Platform,
    Route,
    expandable_segments,
    make_plan,
)


class InputError(Exception):
    """Unreadable input (no such file, bad YAML, no container); str() is one line."""


class Level(Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


class DisaggregationMode(Enum):
    """The side a deployment serves: SGLang's --disaggregation-mode prefill|decode."""

    prefill = "prefill"
    decode = "decode"


@dataclass(frozen=True)
class Finding:
    level: Level
    variable: str  # the variable (or pod field) it is about
    text: str  # what was found and the fix

    def line(self) -> str:
        return f"{self.level.value:<4}  {self.variable}: {self.text}"

    def as_dict(self) -> dict[str, str]:
        return {"status": self.level.value, "variable": self.variable, "detail": self.text}


@dataclass(frozen=True)
class Pod:
    """The pod spec around a container (manifests only)."""

    name: str  # "Deployment/sglang-prefill", "LeaderWorkerSet/pd (worker)"
    host_pid: bool = False
    share_process_namespace: bool = False
    node: Optional[str] = None  # spec.nodeName or nodeSelector kubernetes.io/hostname
    host_network: bool = False  # spec.hostNetwork: the container sees the node's interfaces


@dataclass(frozen=True)
class Environment:
    label: str  # "prefill.env", "Deployment/sglang-prefill container sglang"
    env: dict[str, str]  # what the container sees; a valueFrom MC_* variable reads as ""
    unknown: tuple[tuple[str, str], ...] = ()  # (name, where its value comes from)
    role: Optional[DisaggregationMode] = None
    pod: Optional[Pod] = None
    args: tuple[str, ...] = ()  # command + args
    image: str = ""  # the container's image (manifests only): the versions it runs come with it


# ---------------------------------------------------------------------------------------------
# Parsing

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*$")


def parse_dotenv(text: str, source: str) -> dict[str, str]:
    """KEY=VALUE lines (``export`` optional), ``#`` comments, single quotes (literal), double
    quotes (backslash escapes), an unquoted value ending at `` #``. Raises InputError naming
    the first line that is none of these."""
    env: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _NAME.match(name):
            raise InputError(f"{source}:{n}: expected NAME=VALUE, got {raw.strip()[:60]!r}")
        value = value.strip()
        if value[:1] in ("'", '"'):
            quote = value[0]
            end = value.find(quote, 1)
            while quote == '"' and end > 0 and value[end - 1] == "\\":
                end = value.find(quote, end + 1)
            if end < 0:
                raise InputError(f"{source}:{n}: unterminated {quote} quote in {name}")
            value = value[1:end]
            if quote == '"':
                value = re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)
        else:
            value = value.split(" #", 1)[0].rstrip()
        env[name] = value
    return env


def parse_env_output(text: str) -> dict[str, str]:
    """What ``env`` prints: NAME=value, raw; a line without ``=`` continues the value before."""
    env: dict[str, str] = {}
    last: Optional[str] = None
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and _NAME.match(name):
            env[name] = value
            last = name
        elif last is not None:
            env[last] += "\n" + line
    return env


def _role_of(*texts: str) -> Optional[DisaggregationMode]:
    for text in texts:
        words = set(re.split(r"[^a-z]+", text.lower()))
        if "prefill" in words and "decode" not in words:
            return DisaggregationMode.prefill
        if "decode" in words and "prefill" not in words:
            return DisaggregationMode.decode
    return None


def _mode_arg(args: Sequence[str]) -> Optional[DisaggregationMode]:
    """SGLang's --disaggregation-mode prefill|decode in a command line."""
    for i, arg in enumerate(args):
        value = None
        if arg == "--disaggregation-mode" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--disaggregation-mode="):
            value = arg.split("=", 1)[1]
        if value in ("prefill", "decode"):
            return DisaggregationMode(value)
    return None


def env_file_environment(env: dict[str, str], label: str) -> Environment:
    return Environment(label, env, role=_role_of(label))


_PODSPEC_PATHS: dict[str, list[tuple[str, ...]]] = {  # kind -> where its pod template specs are
    "Pod": [("spec",)],
    "Deployment": [("spec", "template", "spec")],
    "StatefulSet": [("spec", "template", "spec")],
    "DaemonSet": [("spec", "template", "spec")],
    "ReplicaSet": [("spec", "template", "spec")],
    "Job": [("spec", "template", "spec")],
    "CronJob": [("spec", "jobTemplate", "spec", "template", "spec")],
    "LeaderWorkerSet": [("spec", "leaderWorkerTemplate", "leaderTemplate", "spec"),
                        ("spec", "leaderWorkerTemplate", "workerTemplate", "spec")],
}
RELEVANT_PREFIXES = ("SGLANG_", "MC_", "MOONCAKE_") + ALLOC_CONF_VARS


def relevant(name: str) -> bool:
    return name.startswith(RELEVANT_PREFIXES)


def _dig(doc: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _map(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _documents(docs: Sequence[Any]) -> list[dict]:
    out: list[dict] = []
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "List":
            out += _documents(_list(doc.get("items")))
        elif isinstance(doc, dict):
            out.append(doc)
    return out


def parse_manifest(text: str, source: str) -> list[Environment]:
    """Every container of every pod template in `text` (multi-document YAML). ConfigMaps in
    the same file resolve configMapKeyRef / configMapRef; anything else a value comes from
    (secretKeyRef, fieldRef, resourceFieldRef, a ConfigMap not in the file) is named as
    unknown. Raises InputError when the YAML cannot be read or holds no container."""
    import yaml

    try:
        docs = _documents(list(yaml.safe_load_all(text)))
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f":{where.line + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{source}{at}: not valid YAML ({problem})") from None
    config_maps = {_dig(d, ("metadata", "name")): _map(d.get("data"))
                   for d in docs if d.get("kind") == "ConfigMap"}
    out: list[Environment] = []
    for doc in docs:
        paths = _PODSPEC_PATHS.get(doc.get("kind", ""))
        if not paths:
            continue
        name = f"{doc['kind']}/{_dig(doc, ('metadata', 'name')) or '?'}"
        for path in paths:
            spec = _dig(doc, path)
            if not isinstance(spec, dict):
                continue
            pod_name = name
            if doc["kind"] == "LeaderWorkerSet":
                pod_name += " (leader)" if "leaderTemplate" in path else " (worker)"
            selector = _map(spec.get("nodeSelector"))
            pod = Pod(pod_name, bool(spec.get("hostPID")), bool(spec.get("shareProcessNamespace")),
                      spec.get("nodeName") or selector.get("kubernetes.io/hostname"),
                      bool(spec.get("hostNetwork")))
            for container in _list(spec.get("containers")):
                if isinstance(container, dict):
                    out.append(_container(container, pod, config_maps, source))
    if not out:
        raise InputError(f"{source}: no container found (looked in "
                         f"{', '.join(sorted(_PODSPEC_PATHS))} and List documents)")
    return out


def _container(c: dict, pod: Pod, config_maps: Mapping[Any, dict], source: str) -> Environment:
    env: dict[str, str] = {}
    unknown: list[tuple[str, str]] = []
    cname = c.get("name") or "?"
    for item in _list(c.get("envFrom")):  # first, as Kubernetes does; env: entries win
        if not isinstance(item, dict):
            continue
        prefix = str(item.get("prefix") or "")
        if "configMapRef" in item:
            ref = _map(item.get("configMapRef")).get("name")
            if ref in config_maps:
                env.update({prefix + str(k): str(v) for k, v in config_maps[ref].items()})
                continue
            unknown.append((f"{prefix}*", f"envFrom configMapRef {ref} (not in {source})"))
        elif "secretRef" in item:
            unknown.append((f"{prefix}*", f"envFrom secretRef {_map(item.get('secretRef')).get('name')}"))
    for item in _list(c.get("env")):
        if not isinstance(item, dict) or "name" not in item:
            continue
        var = str(item["name"])
        if "valueFrom" not in item:
            value = item.get("value")
            env[var] = "" if value is None else str(value)
            continue
        value_from = _map(item.get("valueFrom"))
        ref = _map(value_from.get("configMapKeyRef"))
        data = config_maps.get(ref.get("name"))
        if ref and data is not None and ref.get("key") in data:
            env[var] = str(data[ref["key"]])
            continue
        kind = next(iter(value_from), "valueFrom")
        what = _map(value_from.get(kind))
        detail = ", ".join(str(what[k]) for k in ("name", "key", "fieldPath", "resource") if k in what)
        unknown.append((var, f"valueFrom {kind}" + (f" {detail}" if detail else "")))
        env.pop(var, None)
        if var.startswith("MC_"):
            env[var] = ""  # Mooncake tests MC_* for presence: set, whatever the value
    args = tuple(str(a) for a in _list(c.get("command")) + _list(c.get("args")))
    role = _mode_arg(args) or _role_of(cname, pod.name)
    return Environment(f"{pod.name} container {cname}", env, tuple(unknown), role, pod, args,
                       str(c.get("image") or ""))


def serving(environment: Environment) -> bool:
    """A container that runs SGLang or sets any SGLang / Mooncake variable."""
    return (any(relevant(k) for k in environment.env) or any(relevant(k) for k, _ in environment.unknown)
            or any("sglang" in a for a in environment.args))


# ---------------------------------------------------------------------------------------------
# Judging one environment


@dataclass(frozen=True)
class Wheel:
    """The Mooncake wheel installed where the doctor runs (not necessarily the image's)."""

    name: str  # "mooncake-transfer-engine-non-cuda 0.3.13.post1", or "no Mooncake wheel"
    nvlink_intra: Optional[bool]  # None: cannot tell


@dataclass
class Reading:
    environment: Environment
    overrides: Optional[dict[str, str]] = None  # the implied profile
    plan: Optional[Plan] = None
    cfg: Optional[OrchestratorConfig] = None
    refusal: Optional[str] = None  # the rule book's (or the reverse mapping's) refusal
    attempt: Optional[Plan] = None  # a refused profile: the plan it would try without its env
    findings: list[Finding] = field(default_factory=list)
    address: str = ""  # the address it would advertise under SGLang's rule, and the step
    advertised: Optional[str] = None  # that address, when the input gives it literally

    @property
    def transport(self) -> Optional[str]:
        """The Mooncake transport the environment brings up (from MC_* presence)."""
        return self.overrides["transport.mooncake.transport"] if self.overrides else None

    @property
    def profile(self) -> list[str]:
        return [f"{k}={v}" for k, v in (self.overrides or {}).items()]


def deployment_platform(env: Mapping[str, str], endpoints: EndpointsConfig) -> Platform:
    """The machine a deployment runs on, as the rule book should see it: as many GPUs as the
    profile places (`endpoints`), a CUDA Mooncake build, an RDMA device (Mooncake's
    auto-discovery case), and the deployment's own environment (its allocator settings count)."""
    e = endpoints
    declared = (e.prefill_gpus or []) + (e.decode_gpus or [])
    gpus = max(2, e.prefill_ranks + e.decode_procs, max(declared, default=0) + 1)
    return Platform(cuda_devices=gpus, mooncake_cuda=True, rdma_devices=("assumed",), env=dict(env))


KEY_VARS = {"mem_pool": POOL_VAR, "transport.route": SEND_AUX_TCP_VAR,
            "transport.mooncake.tcp_progress_timeout_s": TIMEOUT_VAR,
            "buffers.enable_sampling_mask": SAMPLING_MASK_VAR}


def transport_source(env: Mapping[str, str]) -> str:
    """Why Mooncake brings up the transport it does, in its own order of tests."""
    if "MC_FORCE_TCP" in env:
        return "MC_FORCE_TCP is set"
    if "MC_INTRANODE_NVLINK" in env:
        return "MC_INTRANODE_NVLINK is set"
    return "neither MC_FORCE_TCP nor MC_INTRANODE_NVLINK is set"


RDMA_OR_TCP = "RDMA where the node has an HCA, else TCP"


def _transport_var(env: Mapping[str, str]) -> str:
    return "MC_FORCE_TCP" if "MC_FORCE_TCP" in env else "MC_INTRANODE_NVLINK"


def _shown(env: Mapping[str, str], var: str) -> str:
    return f"{var}={env[var]!r}" if var in env else f"{var} (unset)"


def judge(environment: Environment, wheel: Wheel, load: Callable[[list[str]], OrchestratorConfig],
          extra: Sequence[str] = ()) -> Reading:
    """Read one environment: its implied profile, the plan the rule book makes of it, and
    each trap. `load(overrides)` composes and validates a profile (profile.load_profile);
    `extra` are overrides the user adds (e.g. experiment=...), applied first."""
    env = environment.env
    reading = Reading(environment)
    out = reading.findings
    reading.address, reading.advertised, found = advertised_address(environment)
    out += found
    others = []
    for var, where in environment.unknown:
        if var in ADDRESS_VARS:
            continue  # advertised_address says what it means
        if var.endswith("*") or relevant(var):
            presence = var.startswith("MC_")
            out.append(Finding(Level.WARN, var, f"its value comes from {where} and is not in the "
                               "input: " + ("Mooncake tests it for presence only, so it is read as set."
                                            if presence else "read as unset here; check the value it "
                                            "resolves to, or give it literally.")))
        else:
            others.append(f"{var} ({where})")
    if others:
        out.append(Finding(Level.OK, "unknown", f"values not in the input, none of them read by SGLang's "
                                                f"aux path or Mooncake: {', '.join(others)}."))
    try:
        overrides = profile_from_env(env)
    except ConfigError as exc:
        reading.refusal = str(exc)
        out.append(Finding(Level.FAIL, exc.key, f"{exc.allowed}; Mooncake would not read "
                                                f"{exc.value!r} as a timeout."))
        return reading
    reading.overrides = overrides
    out += _variable_traps(env, {name for name, _ in environment.unknown})
    try:
        cfg = load(list(extra) + reading.profile)
    except ProfileError as exc:
        reading.refusal = str(exc)
        out.append(Finding(Level.FAIL, "profile", f"the implied profile cannot be composed: {exc}"))
        return reading
    reading.cfg = cfg
    platform = deployment_platform(env, cfg.endpoints)
    try:
        reading.plan = check_profile(cfg, platform)
    except ConfigError as exc:
        reading.refusal = str(exc)
        out.append(_refusal(exc, env, overrides))
        try:  # what it would try, were the allocator setting not there
            reading.attempt = make_plan(cfg.mem_pool, cfg.transport, cfg.endpoints, cfg.role,
                                        dataclasses.replace(platform, env={}))
        except ConfigError:
            pass
    out += _plan_traps(reading, wheel)
    return reading


ADDRESS_VARS = (*HOST_IP_VARS, NIC_VAR)
WAITING_TIMEOUT_VAR = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
# sgl-project/sglang PR #40107 (open, a preview): the customized_info buffer's capacity per request
CUSTOMIZED_INFO_VAR = "SGLANG_DISAGG_CUSTOMIZED_INFO_MAX_BYTES"
CUSTOMIZED_INFO_DEFAULT = "4096"


def advertised_address(environment: Environment) -> tuple[str, Optional[str], list[Finding]]:
    """The address the environment makes SGLang 0.5.23 advertise (get_local_ip_auto: SGLANG_HOST_IP,
    HOST_IP, SGLANG_LOCAL_IP_NIC, the default route, the hostname), the step that chose it, and
    its traps: (text, the address when the input gives it, findings)."""
    env, unknown = environment.env, dict(environment.unknown)
    for var in HOST_IP_VARS:
        if var in unknown:
            where = unknown[var]
            text = f"the value of {var} ({where}; step {var})"
            if "status.podIP" in where or "status.hostIP" in where:
                text += ": the pod's own address" if "podIP" in where else ": the node's address"
            return text, None, []
        if env.get(var, ""):
            adv = advertise(Host(env))
            flags = address_judge(adv, Host(env))
            return adv.describe(), adv.address, [
                Finding(Level.FAIL if f.fail else Level.WARN, var, f.text.split("; ")[0] +
                        f"; set {var} to an address the peer reaches.") for f in flags]
    nic = env.get(NIC_VAR) or (f"({unknown[NIC_VAR]})" if NIC_VAR in unknown else "")
    if nic:
        return (f"the first address of interface {nic} on its host (step {NIC_VAR})", None,
                [Finding(Level.OK, NIC_VAR, "SGLang imports netifaces for it: the image must have it "
                                            "(pip install netifaces), or SGLang raises ImportError at "
                                            "start-up; an interface that is not there falls through to "
                                            "the default route with a warning.")])
    pod = environment.pod
    if pod is not None and pod.host_network:
        return ("the node's default-route address (step default route: hostNetwork, no "
                f"{'/'.join(ADDRESS_VARS)})", None,
                [Finding(Level.WARN, NIC_VAR, f"{pod.name} has hostNetwork: true and sets neither "
                                              f"SGLANG_HOST_IP nor {NIC_VAR}: SGLang advertises the "
                                              "source address of the node's default route, on a "
                                              "multi-homed node the management network, which the "
                                              "peer may not reach (or reach over the slow network); "
                                              f"set {NIC_VAR}=<the data NIC> or SGLANG_HOST_IP "
                                              "(valueFrom fieldRef status.hostIP).")])
    if pod is not None:
        return "the pod's own address (step default route: the pod's eth0)", None, []
    return ("the source address of its host's default route (step default route: no "
            f"{'/'.join(ADDRESS_VARS)}); run python -m orchestrator.doctor on that host to see it", None, [])


def _variable_traps(env: Mapping[str, str], unknown: set[str]) -> list[Finding]:
    """Traps read off single variables, whatever the plan (`unknown`: names whose value the
    input does not give)."""
    out: list[Finding] = []
    for var in sorted(k for k in env if k.startswith("MC_") and k not in unknown):
        if env[var].strip().lower() in OFF_LOOKING:
            out.append(Finding(Level.WARN, var, f"{env[var]!r} still turns it ON: Mooncake tests MC_* "
                                                f"variables for presence only; `unset {var}` (remove "
                                                "it from the env) to turn it off, set it to 1 if on "
                                                "is meant."))
    new = env.get(NEW_POOL_VAR)
    if new is not None and env.get(POOL_VAR) is None:
        out.append(Finding(Level.WARN, NEW_POOL_VAR,
                           f"{new!r}: SGLang 0.5.23 does not read {NEW_POOL_VAR} (it reads {POOL_VAR}), "
                           "so it runs with no pool, host buffers; the new name comes with sgl-project/"
                           f"sglang PR #38024 (open), which still reads {POOL_VAR} as a deprecated alias: "
                           f"set {POOL_VAR}={new} (read by 0.5.23 and by builds with #38024)."))
    elif new is not None and new != env.get(POOL_VAR):
        out.append(Finding(Level.WARN, NEW_POOL_VAR,
                           f"{NEW_POOL_VAR}={new!r} and {POOL_VAR}={env.get(POOL_VAR)!r} differ: SGLang "
                           f"0.5.23 reads {POOL_VAR}, a build with PR #38024 reads {NEW_POOL_VAR} first; "
                           "the two releases would place the buffers differently; set both to one value."))
    raw = env.get(POOL_VAR)
    if raw is not None and raw.lower() != "true" and raw not in SGLANG_POOLS:
        out.append(Finding(Level.WARN, POOL_VAR, f"{raw!r} is no pool SGLang 0.5.23 knows (NVLINK, "
                                                 "BAREX, INTRA_NODE_NVLINK, case-sensitive, or true "
                                                 "for NVLINK): it runs with no pool, host buffers; "
                                                 "spell the pool exactly or unset it."))
    for var in (SEND_AUX_TCP_VAR, SAMPLING_MASK_VAR):
        if var in env and sglang_bool(env[var]) is None:
            out.append(Finding(Level.WARN, var, f"{env[var]!r} is no boolean SGLang reads (1/true/yes/y, "
                                                "0/false/no/n): it warns and uses false; write 1 or "
                                                "unset it."))
    if "SGLANG_DISAGGREGATION_SAMPLING_MASK_MAX_TOKENS" in env:
        out.append(Finding(Level.FAIL, "SGLANG_DISAGGREGATION_SAMPLING_MASK_MAX_TOKENS",
                           "SGLang 0.5.23 refuses to start with it set (no longer supported): unset it "
                           f"and pass the same --sampling-mask-max-tokens to prefill and decode, with "
                           f"{SAMPLING_MASK_VAR}=1 on both."))
    if WAITING_TIMEOUT_VAR in env:
        out.append(Finding(Level.OK, WAITING_TIMEOUT_VAR,
                           f"{env[WAITING_TIMEOUT_VAR]!r} s bounds Bootstrapping and WaitingForInput only: "
                           "in SGLang 0.5.23 a request whose status arrived but whose metadata row never "
                           "did stays in Transferring past it, holding its decode slot (#31800; "
                           "python -m orchestrator faults=aux_lost shows it)."))
    if CUSTOMIZED_INFO_VAR in env:
        out.append(Finding(Level.OK, CUSTOMIZED_INFO_VAR,
                           "a preview: read only by builds with sgl-project/sglang PR #40107 (open), whose "
                           "customized_info buffer it sizes; SGLang 0.5.23 ignores it. Prefill and decode "
                           "must set the same value (nothing checks it)."))
    if "MC_FORCE_MNNVL" in env:
        wins = [v for v in ("MC_FORCE_TCP", "MC_INTRANODE_NVLINK") if v in env]
        if wins:
            out.append(Finding(Level.WARN, "MC_FORCE_MNNVL", f"ignored ({wins[0]} is tested first); "
                                                             "unset it."))
        else:
            out.append(Finding(Level.FAIL, "MC_FORCE_MNNVL", "set: Mooncake brings up its multi-node "
                                                             "NVLink transport, which the x86_64 wheels "
                                                             "do not build (\"requires -DUSE_MNNVL=ON\"): "
                                                             "initialize fails; unset it."))
    return out


def _refusal(exc: ConfigError, env: Mapping[str, str], overrides: Mapping[str, str]) -> Finding:
    """The rule book's refusal of the implied profile, told in the environment's terms."""
    key = exc.key
    if key in ALLOC_CONF_VARS:
        return Finding(Level.FAIL, key, f"{env[key]!r} turns on PyTorch's expandable segments, and "
                                        "Mooncake's nvlink_intra transport cannot register that "
                                        "memory (cuMemCreate, no CUDA IPC handle): remove "
                                        "expandable_segments:True from it.")
    if key == "transport.mooncake.transport" and overrides.get(key) == "nvlink_intra":
        return Finding(Level.FAIL, "MC_INTRANODE_NVLINK",
                       f"{_shown(env, 'MC_INTRANODE_NVLINK')} brings up Mooncake's intra-node NVLink "
                       f"transport (presence counts, not the value), but {_shown(env, POOL_VAR)} keeps "
                       "the aux buffers on the host, which that transport cannot register: unset "
                       f"MC_INTRANODE_NVLINK, or set {POOL_VAR}=INTRA_NODE_NVLINK.")
    if key == "transport.route":
        return Finding(Level.FAIL, SEND_AUX_TCP_VAR,
                       f"{_shown(env, SEND_AUX_TCP_VAR)} forces the ZMQ tcp route, which reads host "
                       f"memory only, while {_shown(env, POOL_VAR)} puts the aux buffers on the GPU "
                       f"(SGLang would hand GPU pointers to ctypes): unset {SEND_AUX_TCP_VAR}.")
    var = KEY_VARS.get(key) or (_transport_var(env) if key.startswith("transport.mooncake") else key)
    return Finding(Level.FAIL, var, f"the rule book refuses the implied profile: {exc}")


def _plan_traps(reading: Reading, wheel: Wheel) -> list[Finding]:
    env, plan, overrides = reading.environment.env, reading.plan, reading.overrides or {}
    out: list[Finding] = []
    pool = overrides.get("mem_pool")
    transport = reading.transport
    cuda_buffers = pool == MemPoolType.INTRA_NODE_NVLINK.value
    engine = plan is not None and plan.route is Route.engine
    if cuda_buffers and transport != "nvlink_intra" and not (plan is not None and plan.route is Route.tcp):
        came_up = "TCP (MC_FORCE_TCP is set)" if transport == "tcp" else RDMA_OR_TCP
        state = ("set, but MC_FORCE_TCP is tested first" if "MC_INTRANODE_NVLINK" in env
                 else "not set")
        fix = ("unset MC_FORCE_TCP" if "MC_INTRANODE_NVLINK" in env else "export MC_INTRANODE_NVLINK=1"
               + (" and unset MC_FORCE_TCP" if "MC_FORCE_TCP" in env else ""))
        out.append(Finding(Level.FAIL, "MC_INTRANODE_NVLINK",
                           f"{state}, while {POOL_VAR}=INTRA_NODE_NVLINK: SGLang puts the aux buffers "
                           f"on the GPU but Mooncake comes up on {came_up}; BENCHMARKS.md measures "
                           "the TCP case as 'engine tcp, cuda->cuda' (2x H200 at a97ce90: one-in-flight "
                           "handoff p50 1295 us, against 869 us over nvlink_intra). Fix: " + fix + "."))
    if transport == "nvlink_intra" and cuda_buffers:
        if wheel.nvlink_intra is False:
            out.append(Finding(Level.WARN, "mooncake wheel",
                               f"the wheel installed where this doctor runs, {wheel.name}, is built "
                               "without nvlink_intra: if the deployment's image installs it, "
                               "MC_INTRANODE_NVLINK cannot bring up NVLink. The image needs "
                               "mooncake-transfer-engine-cuda13 (CUDA 13) or mooncake-transfer-engine "
                               "(CUDA 12); run this doctor inside the image to check its wheel."))
        elif wheel.nvlink_intra is None:
            out.append(Finding(Level.WARN, "mooncake wheel",
                               f"{wheel.name} here: cannot tell whether nvlink_intra is built in; run "
                               "this doctor inside the deployment's image."))
        else:
            out.append(Finding(Level.OK, "mooncake wheel",
                               f"{wheel.name} here has nvlink_intra (the image's own wheel may differ)."))
    alloc = expandable_segments(env)
    if alloc and cuda_buffers and transport != "nvlink_intra":
        out.append(Finding(Level.WARN, alloc[0], f"{env[alloc[0]]!r} turns on expandable segments: "
                                                 "harmless on this transport, but it breaks NVLink "
                                                 "registration once MC_INTRANODE_NVLINK is set; remove "
                                                 "expandable_segments:True."))
    aux_tcp = sglang_bool(env.get(SEND_AUX_TCP_VAR))
    if aux_tcp and plan is not None and plan.route is Route.tcp and pool != MemPoolType.NVLINK.value:
        out.append(Finding(Level.WARN, SEND_AUX_TCP_VAR,
                           f"{env[SEND_AUX_TCP_VAR]!r} sends every request's aux over the ZMQ tcp route "
                           "(one AUX_DATA message per field) instead of one Mooncake batch write; "
                           f"unset {SEND_AUX_TCP_VAR} for the engine route."))
    protocol = env.get(PROTOCOL_VAR)
    if engine and protocol is not None and transport is not None and protocol.lower() != transport:
        out.append(Finding(Level.WARN, PROTOCOL_VAR,
                           f"{protocol!r}, but Mooncake brings up {transport} ({transport_source(env)}): "
                           "the protocol string does not choose the transport, MC_* presence does; "
                           f"set {PROTOCOL_VAR}={transport} so logs say what runs."))
    return out


def plan_line(reading: Reading) -> str:
    """What SGLang and Mooncake would run: buffer device, route, the transport that comes up."""
    plan, env = reading.plan or reading.attempt, reading.environment.env
    if plan is None:
        return f"refused by the rule book: {reading.refusal}"
    if reading.plan is None:
        return _describe(plan, env) + f"; refused by the rule book: {reading.refusal}"
    return _describe(plan, env)


def _describe(plan: Plan, env: Mapping[str, str]) -> str:
    text = f"buffers on {plan.buffer_device.value}, route {plan.route.value} ({plan.route_reason.value})"
    if plan.route is Route.tcp:
        return text + ": ZMQ AUX_DATA frames, no Mooncake batch write for aux"
    timeout = plan.mc_env.get(TIMEOUT_VAR)
    origin = "" if TIMEOUT_VAR in env else ", Mooncake's default"
    source = transport_source(env)
    if plan.engine_transport is EngineTransport.rdma:
        source += f": {RDMA_OR_TCP}"
    assert plan.engine_transport is not None, "the engine route has a transport"
    return (text + f", Mooncake transport {plan.engine_transport.value} ({source}), "
            f"a write to a stopped peer gives up after {timeout} s{origin}")


# ---------------------------------------------------------------------------------------------
# A prefill against a decode


def pairs(readings: Sequence[Reading]) -> list[tuple[Reading, Reading]]:
    """Every prefill against every decode; two environments of unknown role: the first is the
    prefill."""
    prefills = [r for r in readings if r.environment.role is DisaggregationMode.prefill]
    decodes = [r for r in readings if r.environment.role is DisaggregationMode.decode]
    if prefills and decodes:
        return [(p, d) for p in prefills for d in decodes]
    if len(readings) == 2:
        return [(readings[0], readings[1])]
    return []


def cross_check(a: Reading, b: Reading) -> list[Finding]:
    """A prefill's environment against a decode's: the same pool, the same aux layout, the same
    transport, and (nvlink_intra) one PID namespace."""
    ea, eb = a.environment.env, b.environment.env
    oa, ob = a.overrides or {}, b.overrides or {}
    out: list[Finding] = []

    def both(var: str) -> str:
        return f"prefill {_shown(ea, var)}, decode {_shown(eb, var)}"

    if oa.get("mem_pool") != ob.get("mem_pool"):
        out.append(Finding(Level.FAIL, POOL_VAR, f"differs ({both(POOL_VAR)}): the two sides place "
                                                 "and send aux differently (host or GPU buffers, tcp or "
                                                 "engine route); set the same value on both."))
    if oa.get("buffers.enable_sampling_mask") != ob.get("buffers.enable_sampling_mask"):
        diff = None
        if a.cfg is not None and b.cfg is not None:
            from orchestrator.profile.layout import first_difference, profile_layout

            diff = first_difference(profile_layout(a.cfg.buffers, a.cfg.layout),
                                    profile_layout(b.cfg.buffers, b.cfg.layout))
        out.append(Finding(Level.FAIL, SAMPLING_MASK_VAR,
                           f"differs ({both(SAMPLING_MASK_VAR)}): the aux layouts differ"
                           + (f" ({diff.replace('this side', 'prefill').replace('the peer', 'decode')})"
                              if diff else "")
                           + "; SGLang only logs the field count mismatch and sends the shorter list, "
                             "so fields land in the wrong buffers. Set the same value on both."))
    ta, tb = a.transport, b.transport
    engine = (a.plan is None or a.plan.route is Route.engine) and oa.get("mem_pool") != "NVLINK"
    if ta != tb and engine:
        out.append(Finding(Level.FAIL, _transport_var(ea) if "MC_FORCE_TCP" in ea or "MC_INTRANODE_NVLINK" in ea
                           else _transport_var(eb),
                           f"the two sides bring up different Mooncake transports (prefill {ta}: "
                           f"{transport_source(ea)}; decode {tb}: {transport_source(eb)}); a batch "
                           "write needs the same transport on both ends; set the same MC_* variables "
                           "on both."))
    if sglang_bool(ea.get(SEND_AUX_TCP_VAR)) != sglang_bool(eb.get(SEND_AUX_TCP_VAR)):
        out.append(Finding(Level.WARN, SEND_AUX_TCP_VAR, f"differs ({both(SEND_AUX_TCP_VAR)}): only "
                                                         "the prefill's value chooses the route; set "
                                                         "the same on both to avoid surprises."))
    out += _addresses(a, b) + _previews_and_images(a, b, both)
    if "nvlink_intra" in (ta, tb) and (oa.get("mem_pool") == "INTRA_NODE_NVLINK"
                                       or ob.get("mem_pool") == "INTRA_NODE_NVLINK"):
        out.append(_pid_namespace(a.environment, b.environment))
    if not out:
        out.append(Finding(Level.OK, "prefill/decode", "same pool, same aux layout switches, same "
                                                       f"Mooncake transport ({ta})."))
    return out


def _previews_and_images(a: Reading, b: Reading, both: Callable[[str], str]) -> list[Finding]:
    """A customized_info capacity that differs (a preview of PR #40107), and two images."""
    ea, eb = a.environment.env, b.environment.env
    out: list[Finding] = []
    ca, cb = ea.get(CUSTOMIZED_INFO_VAR, CUSTOMIZED_INFO_DEFAULT), eb.get(CUSTOMIZED_INFO_VAR, CUSTOMIZED_INFO_DEFAULT)
    if ca.strip() != cb.strip():
        out.append(Finding(Level.FAIL, CUSTOMIZED_INFO_VAR,
                           f"differs ({both(CUSTOMIZED_INFO_VAR)}; unset is {CUSTOMIZED_INFO_DEFAULT}): a preview "
                           "of sgl-project/sglang PR #40107 (open), which carries customized_info through the "
                           "metadata buffers at this capacity per request and neither negotiates nor checks "
                           "it between prefill and decode: the two sides' buffers would differ in size; set "
                           "the same value on both (SGLang 0.5.23 reads neither)."))
    ia, ib = a.environment.image, b.environment.image
    if ia and ib and ia != ib:
        out.append(Finding(Level.WARN, "image",
                           f"the prefill runs {ia}, the decode {ib}: SGLang, Mooncake and torch come with "
                           "the image, and a skew between the two sides can fail at run time (Mooncake "
                           "below 0.3.11 on one side and 0.3.11 or later on the other: \"Failed to get "
                           "segment descriptor\", SGLang #26008, Mooncake #2177); run the same image, or "
                           "compare with python -m orchestrator.doctor --peer-versions inside each."))
    return out


def _addresses(a: Reading, b: Reading) -> list[Finding]:
    """A literal loopback address on one side, while the other side advertises another host's
    address (and the two are not containers of one pod, which share loopback)."""
    import ipaddress

    out: list[Finding] = []
    pa, pb = a.environment.pod, b.environment.pod
    if pa is not None and pb is not None and pa.name == pb.name:
        return out
    for r, other, side in ((a, b, "prefill"), (b, a, "decode")):
        try:
            mine = ipaddress.ip_address(r.advertised or "")
            theirs = ipaddress.ip_address(other.advertised or "")
        except ValueError:
            continue
        if mine.is_loopback and not theirs.is_loopback:
            var = next(v for v in HOST_IP_VARS if r.environment.env.get(v))
            out.append(Finding(Level.FAIL, var, f"the {side} advertises {mine} (loopback) while its peer "
                                                f"advertises {theirs}, another host's address: the peer "
                                                f"cannot reach it; set {var} to the {side} host's "
                                                "address the peer reaches."))
    return out


def _pid_namespace(a: Environment, b: Environment) -> Finding:
    """nvlink_intra shares buffers by CUDA IPC, which needs one PID namespace."""
    name = "PID namespace"
    pa, pb = a.pod, b.pod
    if pa is None or pb is None:
        return Finding(Level.WARN, name, "nvlink_intra shares the aux buffers by CUDA IPC, which needs "
                                         "both processes in one PID namespace on one node (docker "
                                         "--pid=host, hostPID: true, or one pod with "
                                         "shareProcessNamespace: true); an env file cannot show it.")
    if pa.name == pb.name:
        if pa.share_process_namespace or pa.host_pid:
            how = "shareProcessNamespace" if pa.share_process_namespace else "hostPID"
            return Finding(Level.OK, name, f"both containers in {pa.name}, {how}: true.")
        return Finding(Level.FAIL, name, f"both containers in {pa.name} without a shared PID namespace: "
                                         "nvlink_intra's CUDA IPC fails across PID namespaces; set "
                                         "shareProcessNamespace: true (or hostPID: true) in its pod "
                                         "spec.")
    if pa.node and pb.node and pa.node != pb.node:
        return Finding(Level.FAIL, name, f"{pa.name} is pinned to node {pa.node}, {pb.name} to "
                                         f"{pb.node}: intra-node NVLink joins GPUs of one node; put "
                                         "both on one node.")
    missing = [p.name for p in (pa, pb) if not p.host_pid]
    if missing:
        return Finding(Level.FAIL, name, f"prefill ({pa.name}) and decode ({pb.name}) are separate pods "
                                         f"and {' and '.join(missing)} lacks hostPID: true: "
                                         "nvlink_intra's CUDA IPC needs both in one PID namespace on "
                                         "one node; set hostPID: true in both pod specs (or run both "
                                         "containers in one pod with shareProcessNamespace: true).")
    return Finding(Level.OK, name, f"{pa.name} and {pb.name} both set hostPID: true (they must also "
                                   "land on one node).")
