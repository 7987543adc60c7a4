"""The team stack with every door locked, end to end.

Certificates are made here (a CA, the stack's certificate, a user's, and a stranger's
signed by another CA). ``pipetune stack up`` is started with the same environment a
user of the stack has: ``PIPETUNE_DASK_TLS_*`` (TLS on Dask, client certificates
required), ``MLFLOW_TRACKING_USERNAME``/``_PASSWORD`` (MLflow's basic auth) and
``PREFECT_API_AUTH_STRING`` (Prefect's auth string). Then:

1. a user runs a small real study with ``pipetune tune`` through it, credentials in the
   environment and in files only; its records are read back from MLflow and Prefect;
2. a Dask client without a certificate (plain TCP, TLS without one, one from another
   CA), an MLflow request and a Prefect API request without (or with wrong) credentials
   are each refused;
3. no secret (the MLflow password, the Prefect auth string, the TLS keys) is in any log
   of the stack or the study, the study's folder, its MLflow params and tags, the
   commands' output, or the command line of any process seen while the stack ran.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from known import synthetic_job
from team import run_stack, skip_without_postgres, stack_folder

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


# -- certificates ---------------------------------------------------------------------------


def _key_and_name(common_name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    return key, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _cert(subject, key, issuer, issuer_key, *, ca: bool):
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(folder: Path, name: str, cert, key=None) -> tuple[str, str | None]:
    from cryptography.hazmat.primitives import serialization

    folder.mkdir(parents=True, exist_ok=True)
    cert_path = folder / f"{name}.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is None:
        return str(cert_path), None
    key_path = folder / f"{name}.key"
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def _pki(folder: Path) -> dict[str, str]:
    """A CA and, signed by it, the stack's and a user's certificate; a stranger's signed
    by another CA. Paths by name."""
    ca_key, ca_name = _key_and_name("pipetune test CA")
    ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
    out = {"ca": _write(folder, "ca", ca)[0]}
    for who in ("stack", "user"):
        key, name = _key_and_name(f"pipetune {who}")
        out[f"{who}_cert"], out[f"{who}_key"] = _write(
            folder, who, _cert(name, key, ca_name, ca_key, ca=False), key)
    other_key, other_name = _key_and_name("another CA")
    other_ca = _cert(other_name, other_key, other_name, other_key, ca=True)
    key, name = _key_and_name("stranger")
    out["stranger_cert"], out["stranger_key"] = _write(
        folder, "stranger", _cert(name, key, other_name, other_key, ca=False), key)
    out["other_ca"] = _write(folder, "other-ca", other_ca)[0]
    return out


# -- watching for secrets ---------------------------------------------------------------------


class ProcessWatch:
    """Every command line ``ps`` shows, sampled until stopped."""

    def __init__(self, every: float = 0.2):
        self.lines: set[str] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)

    def _run(self, every: float) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True,
                                 text=True).stdout
            self.lines.update(out.splitlines())
            self.samples += 1
            self._stop.wait(every)

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _key_lines(path: str) -> list[str]:
    """A PEM key's base64 lines: any one of them, anywhere, is the key leaking."""
    return [ln for ln in Path(path).read_text().splitlines() if ln and not ln.startswith("-")]


def _files_holding(root: Path, needles: dict[str, bytes]) -> list[str]:
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        found += [f"{what} in {path}" for what, needle in needles.items() if needle in data]
    return found


# -- the stack and its doors ------------------------------------------------------------------


def _http(url: str, *, auth: str | None = None, body: dict | None = None) -> tuple[int, object]:
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(url, headers=headers, method="POST" if body else "GET",
                                     data=json.dumps(body).encode() if body else None)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


#: Tries each ``(address, security files)`` with a real Dask client, in a process of its own
#: (a sync client whose connection failed can hang its interpreter's exit): one line each,
#: ``connected`` or ``refused: <error>``.
_DASK_ATTEMPTS = """
import asyncio, json, os, ssl, sys
from distributed import Client
from distributed.comm import connect
from distributed.security import Security

async def attempt(address, files):
    try:
        if files is not None and "tls_client_cert" not in files:
            # Dask's Security makes no client context without a certificate: a TLS
            # context that trusts the CA and offers none, then a request.
            ctx = ssl.create_default_context(cafile=files["tls_ca_file"])
            ctx.check_hostname = False
            comm = await connect(address, timeout=5, ssl_context=ctx)
            await comm.write({"op": "identity"})
            await comm.read()
            return "connected"
        security = Security(require_encryption=True, **files) if files is not None else None
        async with Client(address, asynchronous=True, timeout=5, security=security) as c:
            workers = (await c.scheduler.identity())["workers"]
            return f"connected, {len(workers)} worker(s)"
    except Exception as e:
        return f"refused: {type(e).__name__}: {e}"[:300]

async def main():
    for address, files in json.loads(sys.argv[1]):
        print(await attempt(address, files), flush=True)

asyncio.run(main())
os._exit(0)
"""


def _dask_attempts(*cases: tuple[str, dict | None]) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", _DASK_ATTEMPTS, json.dumps(cases)],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert len(lines) == len(cases), proc.stdout + proc.stderr
    return lines


def test_a_locked_stack_runs_a_study_and_refuses_strangers(tmp_path):
    skip_without_postgres(psycopg=True)
    from mlflow.tracking import MlflowClient

    pki = _pki(tmp_path / "pki")
    password = secrets.token_urlsafe(18)
    auth_string = f"pipetune:{secrets.token_urlsafe(18)}"
    locks = {
        "MLFLOW_TRACKING_USERNAME": "team-admin", "MLFLOW_TRACKING_PASSWORD": password,
        "PREFECT_API_AUTH_STRING": auth_string,
        "PIPETUNE_DASK_TLS_CA_FILE": pki["ca"], "PIPETUNE_DASK_TLS_CERT": pki["stack_cert"],
        "PIPETUNE_DASK_TLS_KEY": pki["stack_key"],
    }
    needles = {"the MLflow password": password.encode(),
               "the Prefect auth string": auth_string.encode(),
               "the Prefect auth string (base64)": base64.b64encode(auth_string.encode()),
               "the auth string's secret": auth_string.split(":", 1)[1].encode()}
    for who in ("stack", "user"):
        for i, line in enumerate(_key_lines(pki[f"{who}_key"])):
            needles[f"line {i} of the {who}'s TLS key"] = line.encode()

    home = tmp_path / "user"
    home.mkdir()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("PREFECT_", "MLFLOW_", "PIPETUNE_"))}
    base.update(HOME=str(home), PIPETUNE_HOME=str(home / ".pipetune"),
                PREFECT_HOME=str(home / ".prefect"), MLFLOW_DISABLE_TELEMETRY="true",
                PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(REPO))
    outputs = []
    with stack_folder("pipetune-locked-") as directory, ProcessWatch() as watch:
        up = run_stack("up", "--dir", str(directory), "--workers", "1",
                       env={**base, **locks})
        outputs.append(up.stdout + up.stderr)
        assert up.returncode == 0, f"stack up failed:\n{up.stdout}\n{up.stderr}"
        state = json.loads((directory / "stack.json").read_text())
        assert state["doors"] == {
            "dask_tls": {"tls_ca_file": pki["ca"], "tls_client_cert": pki["stack_cert"],
                         "tls_client_key": pki["stack_key"]},
            "mlflow_basic_auth": "team-admin", "prefect_auth_string": True}
        address = state["env"]["PIPETUNE_DASK_ADDRESS"]
        assert address.startswith("tls://127.0.0.1:"), address
        assert "locked       Prefect: auth string" in up.stdout
        shell = run_stack("env", "--dir", str(directory), env=base)  # no secret needed
        outputs.append(shell.stdout + shell.stderr)
        assert f"export PIPETUNE_DASK_ADDRESS={address}" in shell.stdout
        assert f"export PIPETUNE_DASK_TLS_KEY={pki['stack_key']}" in shell.stdout

        # -- 1. a user tunes through it: the stack's env, the user's own certificate ----------
        user = {**base, **state["env"], **locks,
                "PIPETUNE_DASK_TLS_CERT": pki["user_cert"],
                "PIPETUNE_DASK_TLS_KEY": pki["user_key"]}
        job_file = home / "locked-job.yaml"
        job_file.write_text(json.dumps(synthetic_job("locked-job", trials=2)))
        started = time.monotonic()
        tune = subprocess.run([sys.executable, "-m", "pipetune", "tune", str(job_file)],
                              env=user, cwd=REPO, capture_output=True, text=True, timeout=600)
        outputs.append(tune.stdout + tune.stderr)
        assert tune.returncode == 0, f"tune failed:\n{tune.stdout}\n{tune.stderr}"
        tune_s = time.monotonic() - started

        mlflow_url, prefect_api = state["urls"]["mlflow"], state["urls"]["prefect_api"]
        os.environ["MLFLOW_TRACKING_USERNAME"] = "team-admin"
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password
        try:
            client = MlflowClient(mlflow_url)
            exp = client.get_experiment_by_name("pipetune")
            (study,) = client.search_runs([exp.experiment_id], "tags.`pipetune.kind` = 'study'")
            trials = client.search_runs(
                [exp.experiment_id], f"tags.mlflow.parentRunId = '{study.info.run_id}'")
        finally:
            del os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]
        assert study.info.status == "FINISHED" and study.info.run_id in tune.stdout + tune.stderr
        assert len(trials) == 2 and {t.info.status for t in trials} == {"FINISHED"}
        flow_run_id = study.data.tags["prefect.flow_run_id"]
        code, flow_run = _http(f"{prefect_api}/flow_runs/{flow_run_id}", auth=auth_string)
        assert code == 200 and flow_run["state"]["type"] == "COMPLETED", (code, flow_run)
        code, epochs = _http(f"{prefect_api}/task_runs/filter", auth=auth_string, body={
            "flow_runs": {"id": {"any_": [flow_run_id]}},
            "task_runs": {"name": {"like_": "epoch"}}})
        assert code == 200 and len(epochs) >= 2, (code, epochs)

        # -- 1b. the same job as a deployment run: the stack's worker has the keys ---------
        def prefect(*args: str) -> str:
            proc = subprocess.run([sys.executable, "-m", "prefect", *args], env=user,
                                  cwd=REPO, capture_output=True, text=True, timeout=300)
            outputs.append(proc.stdout + proc.stderr)
            assert proc.returncode == 0, f"prefect {args[0]}:\n{proc.stdout}\n{proc.stderr}"
            return proc.stdout + proc.stderr

        prefect("--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml",
                "--name", "on-demand")
        ran = prefect("deployment", "run", "pipetune-study/on-demand", "--param",
                      f"job={json.dumps(synthetic_job('locked-deployed', trials=2))}")
        deployed_id = ran.split("UUID:", 1)[1].split()[0]
        deadline = time.monotonic() + 300
        while True:
            code, deployed = _http(f"{prefect_api}/flow_runs/{deployed_id}", auth=auth_string)
            assert code == 200, (code, deployed)
            if deployed["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            assert time.monotonic() < deadline, f"deployed run {deployed['state']['type']}"
            time.sleep(1)
        assert deployed["state"]["type"] == "COMPLETED", deployed["state"]
        os.environ["MLFLOW_TRACKING_USERNAME"] = "team-admin"
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password
        try:
            (deployed_study,) = client.search_runs(
                [exp.experiment_id], f"tags.`prefect.flow_run_id` = '{deployed_id}' "
                "and tags.`pipetune.kind` = 'study'")
            deployed_trials = client.search_runs(
                [exp.experiment_id],
                f"tags.mlflow.parentRunId = '{deployed_study.info.run_id}'")
        finally:
            del os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]
        assert deployed_study.info.status == "FINISHED"
        assert len(deployed_trials) == 2
        assert {t.info.status for t in deployed_trials} == {"FINISHED"}

        # -- 2. strangers are refused -----------------------------------------------------
        plain = address.replace("tls://", "tcp://")
        ca = {"tls_ca_file": pki["ca"]}
        no_cert, stranger, plain_tcp, user_cert = _dask_attempts(
            (address, ca),  # TLS, the right CA, no certificate of its own
            (address, {**ca, "tls_client_cert": pki["stranger_cert"],
                       "tls_client_key": pki["stranger_key"]}),  # another CA's certificate
            (plain, None),  # plain TCP
            (address, {**ca, "tls_client_cert": pki["user_cert"],
                       "tls_client_key": pki["user_key"]}))  # the user's: opens it
        assert no_cert.startswith("refused") and stranger.startswith("refused"), (
            no_cert, stranger)
        assert plain_tcp.startswith("refused"), plain_tcp
        print("dask refusals:", no_cert, stranger, plain_tcp, sep="\n  ")
        assert user_cert == "connected, 1 worker(s)", user_cert

        search = f"{mlflow_url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=pipetune"
        assert _http(search)[0] == 401
        assert _http(search, auth="team-admin:not-the-password")[0] == 401
        assert _http(search, auth=f"team-admin:{password}")[0] == 200

        assert _http(f"{prefect_api}/flow_runs/filter", body={"limit": 1})[0] == 401
        assert _http(f"{prefect_api}/flow_runs/filter", body={"limit": 1},
                     auth="pipetune:wrong")[0] == 401
        assert _http(f"{prefect_api}/flow_runs/filter", body={"limit": 1},
                     auth=auth_string)[0] == 200

        recorded = []
        for run in (study, *trials, deployed_study, *deployed_trials):
            recorded += [f"{k}={v}" for k, v in run.data.params.items()]
            recorded += [f"{k}={v}" for k, v in run.data.tags.items()]

        # -- 3. no secret anywhere it could be read --------------------------------------
        stack_files = [*sorted((directory / "logs").glob("*.log")), directory / "stack.json",
                       directory / "mlflow" / "basic_auth.ini"]
        leaks = [f"{what} in {path}" for path in stack_files for what, needle in needles.items()
                 if needle in path.read_bytes()]
    leaks += _files_holding(home, needles)  # the study's folder and logs, the user's HOME
    blobs = {"the MLflow params and tags": "\n".join(recorded),
             "the commands' output": "\n".join(outputs),
             "a process's command line": "\n".join(watch.lines)}
    leaks += [f"{what} in {where}" for where, text in blobs.items()
              for what, needle in needles.items() if needle.decode() in text]
    assert not leaks, leaks
    print(f"\nlocked stack up: {state['startup_s']}; `pipetune tune` (2 trials) {tune_s:.1f} s; "
          f"{watch.samples} process-list samples, {len(watch.lines)} command lines")
    assert list((home / ".pipetune" / "studies").iterdir()), "no study folder was scanned"
    assert watch.samples >= 10 and any("dask worker" in ln or "dask-worker" in ln
                                       for ln in watch.lines), watch.samples
    # The keys' paths (not their contents) are what a command line may show.
    assert any(pki["stack_key"] in ln for ln in watch.lines)
