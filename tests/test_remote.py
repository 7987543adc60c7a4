"""Reaching a Dask scheduler pipetune did not start: the address rule and TLS settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipetune.dask.address import check_scheduler_address, client_security
from pipetune.errors import SpecError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("address", [
    "tcp://127.0.0.1:8786", "tcp://127.8.9.1:1", "tcp://localhost:8786", "tcp://[::1]:8786",
    "tls://10.0.0.5:8786", "tls://scheduler.example.org:8786",
])
def test_loopback_tcp_and_tls_anywhere_are_accepted(address, monkeypatch):
    monkeypatch.delenv("PIPETUNE_DASK_ALLOW_INSECURE", raising=False)
    assert check_scheduler_address(address) == address


@pytest.mark.parametrize("address", ["tcp://10.0.0.5:8786", "tcp://scheduler.example.org:1"])
def test_plain_tcp_to_another_host_is_refused_unless_allowed(address, monkeypatch):
    monkeypatch.delenv("PIPETUNE_DASK_ALLOW_INSECURE", raising=False)
    with pytest.raises(SpecError) as e:
        check_scheduler_address(address)
    assert e.value.field == "--dask-address"
    assert "tls://" in e.value.message and "--allow-insecure-dask" in e.value.message
    assert check_scheduler_address(address, allow_insecure=True) == address
    monkeypatch.setenv("PIPETUNE_DASK_ALLOW_INSECURE", "1")
    assert check_scheduler_address(address) == address
    with pytest.raises(SpecError):  # an explicit "no" wins over the environment
        check_scheduler_address(address, allow_insecure=False)


@pytest.mark.parametrize("address", ["10.0.0.5:8786", "tcp://", "http://127.0.0.1:8786",
                                     "tcp://a b:1"])
def test_a_malformed_address_names_the_field(address):
    with pytest.raises(SpecError, match="tcp://HOST:PORT") as e:
        check_scheduler_address(address, field="dask_address")
    assert e.value.field == "dask_address"


def test_tls_settings_make_a_security_or_name_what_is_missing(monkeypatch, tmp_path):
    for var in ("PIPETUNE_DASK_TLS_CA_FILE", "PIPETUNE_DASK_TLS_CERT", "PIPETUNE_DASK_TLS_KEY"):
        monkeypatch.delenv(var, raising=False)
    assert client_security() is None
    monkeypatch.setenv("PIPETUNE_DASK_TLS_CA_FILE", str(tmp_path / "ca.pem"))
    with pytest.raises(SpecError) as e:
        client_security()
    assert e.value.field == "PIPETUNE_DASK_TLS_CERT"
    monkeypatch.setenv("PIPETUNE_DASK_TLS_CERT", str(tmp_path / "cert.pem"))
    monkeypatch.setenv("PIPETUNE_DASK_TLS_KEY", str(tmp_path / "key.pem"))
    with pytest.raises(SpecError, match="no such file"):
        client_security()
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("-----BEGIN CERTIFICATE-----\n")
    security = client_security()
    assert security.require_encryption
    assert security.tls_ca_file == str(tmp_path / "ca.pem")
    assert security.tls_client_key == str(tmp_path / "key.pem")


def test_tune_refuses_plain_tcp_to_another_host_before_anything_starts(tmp_path):
    env = {"PIPETUNE_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin",
           "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.run(
        [sys.executable, "-m", "pipetune", "tune", "examples/tiny_synthetic.yaml",
         "--dask-address", "tcp://10.1.2.3:8786", "--tracking-uri",
         f"sqlite:///{tmp_path / 'mlflow.db'}"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --dask-address: tcp://10.1.2.3:8786 is plain TCP")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "home" / "studies").exists()
