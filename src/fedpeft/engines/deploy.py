"""Deploying the Flower engine: the app folder, TLS certificates, SuperNode keys, and a loopback
deployment (one SuperLink, N SuperNodes on 127.0.0.1) for ``fedpeft deploy local``, tests and
benchmarks.

On real machines the same pieces are started by hand (README, "Run on several machines"):
``flower-superlink`` with the server certificate (and ``--enable-supernode-auth``), ``flwr
supernode register`` with each node's public key, ``flower-supernode --node-config
"partition-id=i num-partitions=N"`` on every client machine with the CA certificate (and its
private key), then ``flwr run APP_DIR CONNECTION --stream`` with the folder
:func:`write_app` made. Flower's telemetry, update check and runtime dependency installation are
switched off in every process started here (:func:`flower_env`): fedpeft must already be
installed on every machine, and nothing is fetched from a registry at run time.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import tomli_w
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedpeft.config import ConfigError, ExperimentConfig

CONNECTION = "fedpeft-local"
APP_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]*$")


def flower_env(flwr_home: Path) -> dict[str, str]:
    """The environment for Flower processes: no telemetry, no update check, no ``uv sync`` at run time."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # Flower spawns by name
    return {**os.environ, "PATH": path, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_HOME": str(flwr_home),
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2", "PYTHONUNBUFFERED": "1"}


def flower_executable(name: str) -> str:
    """A Flower command from this interpreter's environment (else from PATH)."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: install Flower with `pip install 'flwr>=1.41,<1.42'`")
    return found


def run_config(cfg: ExperimentConfig, run_dir: Path, data_dir: str | None = None, resume: bool = False
               ) -> dict[str, str | bool]:
    """The Flower run config both apps read: the experiment (as YAML, engine ``flower``) and where to write."""
    raw = cfg.model_dump(mode="json")
    raw["engine"]["kind"] = "flower"
    return {"experiment": yaml.safe_dump(raw, sort_keys=False), "run-dir": str(Path(run_dir).resolve()),
            "resume": resume, "data-dir": data_dir or ""}


def write_app(cfg: ExperimentConfig, out_dir: Path, run_dir: Path, data_dir: str | None = None,
              resume: bool = False) -> Path:
    """A Flower app folder (``pyproject.toml``) whose run config carries the experiment.

    ``flwr run OUT_DIR CONNECTION`` then starts fedpeft's ServerApp on the SuperLink; its
    ``run-dir`` (absolute, on the SuperLink's machine) receives metrics and checkpoints.
    """
    if not APP_NAME.match(out_dir.resolve().name):
        raise ConfigError("--out", f"Flower needs an app folder named with letters, digits and hyphens, "
                                   f"starting with a letter; got {out_dir.resolve().name!r}")
    pyproject = {
        "project": {"name": "fedpeft-app", "version": "1.0.0", "license": "Apache-2.0",
                    "description": f"fedpeft {cfg.method} on {cfg.task.name} (Flower deployment)",
                    "dependencies": ["flwr>=1.41,<1.42"]},
        "tool": {"flwr": {"app": {
            "publisher": "fedpeft",
            "components": {"serverapp": "fedpeft.engines.flower:server_app",
                           "clientapp": "fedpeft.engines.flower:client_app"},
            "config": run_config(cfg, run_dir, data_dir, resume),
        }}},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pyproject.toml").write_text(tomli_w.dumps(pyproject))
    return out_dir


@dataclass
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path


def write_certificates(out_dir: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 365
                       ) -> Certificates:
    """A self-signed CA and a SuperLink certificate it signs, valid for ``hosts`` (IPs or DNS names).

    ``ca.crt`` goes to every SuperNode (``--root-certificates``) and to ``flwr``'s connection
    (``root-certificates``); ``server.pem``/``server.key`` stay on the SuperLink.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpeft test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False),
                              critical=True)
               .sign(ca_key, hashes.SHA384()))
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
                   .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=days))
                   .add_extension(x509.SubjectAlternativeName(names), critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                   .sign(ca_key, hashes.SHA384()))
    certs = Certificates(out_dir / "ca.crt", out_dir / "server.pem", out_dir / "server.key")
    certs.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    certs.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    certs.server_key.write_bytes(server_key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    certs.server_key.chmod(0o600)
    return certs


def write_node_keys(out_dir: Path, count: int) -> list[tuple[Path, Path]]:
    """``count`` SuperNode key pairs (EC P-384, OpenSSH format, as ``ssh-keygen -t ecdsa -b 384``).

    The private key stays on its SuperNode (``--auth-supernode-private-key``); the public key is
    registered with the SuperLink (``flwr supernode register``).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    pairs = []
    for index in range(count):
        key = ec.generate_private_key(ec.SECP384R1())
        private, public = out_dir / f"node{index}", out_dir / f"node{index}.pub"
        private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                              serialization.NoEncryption()))
        private.chmod(0o600)
        public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                         serialization.PublicFormat.OpenSSH) + b"\n")
        pairs.append((private, public))
    return pairs


def process_table() -> dict[int, tuple[int, int]]:
    """Every live process: pid -> (parent pid, session id), from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # the command name may hold spaces
        except OSError:
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[3]))
    return table


def descendants(root: int) -> list[int]:
    """``root`` and every live process it started: children, their children, and everything in the
    sessions they opened (Ray's workers are re-parented to init but stay in their session)."""
    table = process_table()
    if root not in table:
        return []
    own_session = os.getsid(0)  # never this process's own session (the caller and its siblings live there)
    found = {root}
    while True:
        sessions = {table[pid][1] for pid in found} - {own_session}
        more = {pid for pid, (parent, session) in table.items()
                if pid not in found and (parent in found or session in sessions)}
        if not more:
            return sorted(found)
        found |= more


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:g} s")


@dataclass
class LocalDeployment:
    """One SuperLink and ``num_nodes`` SuperNodes on 127.0.0.1 with free ports, optionally with TLS and
    SuperNode authentication; every process it starts is stopped on exit (also on failure).

    ``simulation``: instead of SuperNodes, the SuperLink runs Flower's Simulation Engine (Ray,
    ``pip install 'fedpeft[simulation]'``) with ``num_nodes`` virtual SuperNodes, each ClientApp
    worker reserving ``cpus_per_client`` CPUs and ``gpus_per_client`` of a GPU (0.25: four workers
    share one GPU).
    """

    work_dir: Path
    num_nodes: int
    tls: bool = False
    auth: bool = False
    data_dir: str | None = None
    simulation: bool = False
    cpus_per_client: int = 1
    gpus_per_client: float = 0.0
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: list[IO[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir).resolve()
        self.home = self.work_dir / "flwr-home"
        self.env = flower_env(self.home)
        # Ray puts AF_UNIX sockets under RAY_TMPDIR, whose paths may not exceed 107 bytes: a short
        # folder of its own, not one under a possibly deep work dir
        self.ray_dir = Path(tempfile.mkdtemp(prefix="fedpeft-ray-")) if self.simulation else None
        if self.ray_dir is not None:
            self.env["RAY_TMPDIR"] = str(self.ray_dir)
        self.port = free_port()
        self.certs: Certificates | None = None

    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen:
        log = (self.work_dir / f"{name}.log").open("ab")
        self.logs.append(log)
        process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.work_dir,
                                   start_new_session=True)  # own process group: stopping it stops its children
        self.processes[name] = process
        return process

    def _security_args(self, role: str) -> list[str]:
        if self.certs is None:
            return ["--insecure"]
        if role == "superlink":
            return ["--ssl-ca-certfile", str(self.certs.ca), "--ssl-certfile", str(self.certs.server_cert),
                    "--ssl-keyfile", str(self.certs.server_key)]
        return ["--root-certificates", str(self.certs.ca)]

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        if self.tls or self.auth:  # Flower authenticates SuperNodes only over TLS
            self.certs = write_certificates(self.work_dir / "certs")
        superlink = [flower_executable("flower-superlink"), *self._security_args("superlink"), "--host", "127.0.0.1",
                     "--port", str(self.port), "--database", str(self.work_dir / "superlink.db"),
                     "--disable-runtime-dependency-installation"]
        if self.auth:
            superlink.append("--enable-supernode-auth")
        if self.simulation:
            superlink += ["--simulation", "--isolation", "subprocess"]
        wait_for_port(self.port, 120, self._spawn("superlink", superlink))
        connection: dict[str, object] = {"address": f"127.0.0.1:{self.port}"}
        if self.certs is None:
            connection["insecure"] = True
        else:
            connection["root-certificates"] = str(self.certs.ca)
        (self.home / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": CONNECTION,
                                                                            CONNECTION: connection}}))
        if self.simulation:
            return
        keys = write_node_keys(self.work_dir / "keys", self.num_nodes) if self.auth else []
        for _, public in keys:
            subprocess.run([flower_executable("flwr"), "supernode", "register", str(public), CONNECTION],
                           env=self.env, check=True, capture_output=True, timeout=120)
        for index in range(self.num_nodes):
            node_config = f"partition-id={index} num-partitions={self.num_nodes}"
            if self.data_dir:
                node_config += f' data-dir="{self.data_dir}"'
            command = [flower_executable("flower-supernode"), *self._security_args("supernode"),
                       "--superlink", f"127.0.0.1:{self.port}", "--host", "127.0.0.1", "--port", str(free_port()),
                       "--node-config", node_config]
            if keys:
                command += ["--auth-supernode-private-key", str(keys[index][0])]
            self._spawn(f"supernode{index}", command)

    def start_run(self, app_dir: Path, output: IO[bytes] | None = None) -> subprocess.Popen:
        """Start ``flwr run APP_DIR --stream``; it returns when the run ends."""
        command = [flower_executable("flwr"), "run", str(Path(app_dir).resolve()), CONNECTION, "--stream"]
        if self.simulation:
            command += ["--federation-config", f"num-supernodes={self.num_nodes} "
                        f"client-resources-num-cpus={self.cpus_per_client} "
                        f"client-resources-num-gpus={self.gpus_per_client}"]
        process = subprocess.Popen(command, env=self.env, stdout=output, stderr=subprocess.STDOUT if output else None,
                                   cwd=self.work_dir, start_new_session=True)
        self.processes[f"run{len(self.processes)}"] = process
        return process

    def run(self, app_dir: Path, timeout: float, output: IO[bytes] | None = None) -> int:
        """``flwr run APP_DIR --stream`` to the end of the run; returns its exit status."""
        return self.start_run(app_dir, output).wait(timeout=timeout)

    def tree(self, name: str) -> list[int]:
        """``name``'s process and all its live descendants (Flower detaches some into new sessions)."""
        return descendants(self.processes[name].pid)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to ``name`` and every process it started (SIGKILL: a crash, no goodbye)."""
        signal_all(self.tree(name), sig)
        self.processes[name].wait(timeout=30)

    def stop(self) -> None:
        """Stop every process this deployment started: SIGTERM, then SIGKILL after 10 s."""
        started = [pid for name in self.processes for pid in self.tree(name)]
        signal_all(started, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        signal_all(started, signal.SIGKILL)
        for process in self.processes.values():
            process.wait()
        self.processes.clear()
        for log in self.logs:
            log.close()
        self.logs.clear()
        if self.ray_dir is not None:
            shutil.rmtree(self.ray_dir, ignore_errors=True)
