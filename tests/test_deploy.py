"""Flower deployment helpers: the app folder Flower accepts, a certificate chain that verifies, node keys
in the format Flower loads, and process trees followed into the sessions Flower detaches."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
from flwr.cli.config_utils import load_and_validate

from fedpeft.cli import main
from fedpeft.config import ConfigError, build_config
from fedpeft.engines.deploy import descendants, write_app, write_certificates, write_node_keys
from fedpeft.engines.flower import RunSettings
from tests.conftest import tiny_raw_config


def test_app_folder_is_a_valid_flower_app_carrying_the_experiment(toy_files: tuple[Path, Path],
                                                                  tmp_path: Path) -> None:
    cfg = build_config(tiny_raw_config(*toy_files, tmp_path / "run", method="flasc"))
    app = write_app(cfg, tmp_path / "my-app", tmp_path / "run", resume=True)
    config, _ = load_and_validate(app / "pyproject.toml")  # components resolve to fedpeft's apps
    components = config["tool"]["flwr"]["app"]["components"]
    assert components == {"serverapp": "fedpeft.engines.flower:server_app",
                          "clientapp": "fedpeft.engines.flower:client_app"}
    settings = RunSettings.from_run_config(config["tool"]["flwr"]["app"]["config"])
    assert settings.resume and settings.run_dir == (tmp_path / "run").resolve()
    carried = settings.config()
    assert carried.engine.kind == "flower" and carried.method == "flasc"
    assert carried.model_dump(exclude={"engine"}) == cfg.model_dump(exclude={"engine"})
    with pytest.raises(ConfigError, match="--out"):
        write_app(cfg, tmp_path / "my_app", tmp_path / "run")  # Flower's app names allow no underscore


def test_certificates_chain_to_the_ca_and_name_the_hosts(tmp_path: Path) -> None:
    certs = write_certificates(tmp_path, ("10.0.0.5", "superlink.example"))
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    server = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert names.get_values_for_type(x509.DNSName) == ["superlink.example"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert certs.server_key.stat().st_mode & 0o077 == 0


def test_node_keys_load_as_flower_loads_them(tmp_path: Path) -> None:
    (private, public), _ = write_node_keys(tmp_path, 2)
    key = load_ssh_private_key(private.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert load_ssh_public_key(public.read_bytes()) == key.public_key()
    assert public.read_text().startswith("ecdsa-sha2-nistp384 ")


def test_deploy_cli_writes_the_pieces(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(tiny_raw_config(*toy_files, tmp_path / "run")))
    assert main(["deploy", "app", str(config), "--out", str(tmp_path / "app"), "--set", "rounds=5"]) == 0
    settings = RunSettings.from_run_config(load_and_validate(tmp_path / "app" / "pyproject.toml")[0]
                                           ["tool"]["flwr"]["app"]["config"])
    assert settings.config().rounds == 5
    assert main(["deploy", "certs", "--out", str(tmp_path / "certs")]) == 0
    assert main(["deploy", "keys", "--out", str(tmp_path / "keys"), "--nodes", "3"]) == 0
    assert sorted(p.name for p in (tmp_path / "keys").iterdir())[-2:] == ["node2", "node2.pub"]
    assert {p.name for p in (tmp_path / "certs").iterdir()} >= {"ca.crt", "server.pem", "server.key"}


def test_descendants_follow_children_into_detached_sessions() -> None:
    """A child that opens its own session (as Flower's SuperExec does) starts a grandchild and exits; the
    grandchild, re-parented away from the tree (as Ray's workers are), is still found by its session."""
    middle = ("import subprocess, sys; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])")
    script = (f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {middle!r}], "
              "start_new_session=True)\ntime.sleep(60)\n")
    root = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(descendants(root.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        found = descendants(root.pid)
        assert len(found) == 3 and root.pid in found
    finally:
        for pid in descendants(root.pid):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        root.wait()
