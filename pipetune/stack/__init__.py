"""The team stack: every server pipetune talks to, started in one folder by one command.

``pipetune stack up [--dir DIR] [--host H] [--workers N] [--cores-per-worker C]`` starts
PostgreSQL, then the Prefect server, MLflow and the Dask scheduler side by side (launched
together, then each waited for until healthy), the Dask workers once the scheduler
answers and the Prefect worker and the work pool once the Prefect server does
(:mod:`pipetune.stack.lifecycle`):

1. **PostgreSQL** (:class:`~pipetune.stack.postgres.Postgres`): one server, databases
   ``prefect``, ``mlflow`` and ``pipetune`` (the ground truth). Exposes one TCP port
   (``listen_addresses`` = H) and a Unix socket in a folder only its user can enter.
   On loopback, connections from 127.0.0.1 are trusted (no password); on any other
   host every connection needs the superuser's generated password
   (``scram-sha-256``; it is in ``stack.json`` and ``postgres/password``, both 0600).
   Protect it further with ``ssl = on`` and ``hostssl`` lines in ``pg_hba.conf``.
2. **Prefect server** (``prefect server start``) on that PostgreSQL: the API and UI on
   one HTTP port (``/api``, health ``/api/health``). Then the work pool ``pipetune``
   (type ``process``, concurrency limit 1: one flow run at a time), created through the
   API, and one **Prefect worker** on it (no port: it polls the API; it gives the pool
   its base job template).
   Locked with an auth string when ``PREFECT_API_AUTH_STRING`` is set (below).
3. **MLflow tracking server** (``mlflow server``) on PostgreSQL, artifacts proxied
   (``--serve-artifacts``) into ``DIR/mlflow-artifacts``: one HTTP port (health
   ``/health``; MLflow 3's job runner for GenAI scorers is off:
   ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` unless set); ``--allowed-hosts`` set
   when H is not loopback. Locked with MLflow's basic auth when
   ``MLFLOW_TRACKING_USERNAME`` and ``MLFLOW_TRACKING_PASSWORD`` are set (below).
4. **Dask scheduler** (``dask scheduler``): one TCP port (``tcp://H:P``) and an HTTP
   port (health, metrics; the dashboard when bokeh is installed). Then N **Dask
   workers** (``dask worker``, one process each, C threads, resource ``cores=C``, named
   ``w-1`` ... ``w-N``), each with a folder and a ``HOME`` of its own
   (``DIR/workers/w-i``), ``PREFECT_API_URL``, ``MLFLOW_TRACKING_URI`` and
   ``PIPETUNE_CHECKPOINTS`` set (as the Prefect worker has) and the
   repository on ``PYTHONPATH`` (``PIPETUNE_HOME`` unset, so it follows that ``HOME``);
   each listens on a port of its own, its nanny's and an HTTP port (health, metrics),
   all bound to H. Dask has no passwords: locked with TLS and client certificates when
   ``PIPETUNE_DASK_TLS_*`` are set (below).

**Locked doors** (:mod:`pipetune.stack.doors`): ``up`` reads the same variables a client
of the stack sets, each lock on its own:

- ``PIPETUNE_DASK_TLS_CA_FILE``, ``PIPETUNE_DASK_TLS_CERT``, ``PIPETUNE_DASK_TLS_KEY``:
  the scheduler and workers listen on ``tls://`` with that certificate and accept only
  peers with a certificate the CA signed (plain TCP, no certificate or another CA's:
  refused); the address in ``stack env`` is ``tls://`` and the three paths are
  exported with it (a user replaces the certificate and key with their own);
- ``MLFLOW_TRACKING_USERNAME`` and ``MLFLOW_TRACKING_PASSWORD`` (12 characters or
  more): ``mlflow server --app-name basic-auth`` with that user as its admin (users in
  ``DIR/mlflow/basic_auth.db``; a later ``up`` keeps the stored password; the Flask
  secret key in ``DIR/mlflow/flask-secret-key``, 0600); needs ``mlflow[auth]``;
- ``PREFECT_API_AUTH_STRING`` (or ``PREFECT_SERVER_API_AUTH_STRING``): the Prefect
  server answers only requests carrying it (``/api/health`` excepted).

The Prefect worker and the Dask workers get the credentials they need in their
environment. No secret is put on a command line, in a log or in ``stack.json``
(``doors`` there says which locks are on, and the TLS files' paths). Half a lock (a user
without a password, two of the three TLS files) is refused before anything starts.

On anything but 127.0.0.1, unlocked, only PostgreSQL gets a password from this command:
the Prefect API, MLflow and Dask are open to whoever reaches the ports.

Each component is a detached process (a session of its own, it outlives ``up``) with
``DIR/logs/<name>.log`` and ``DIR/run/<name>.pid``. ``DIR/stack.json`` (mode 0600)
holds: ``version``, ``dir``, ``host``, ``state`` (starting, running, failed, stopped),
``started_at``, ``workers``, ``cores_per_worker``, ``work_pool``,
``work_pool_concurrency_limit``, ``ports``, ``urls``
(``postgres``, ``prefect_api``, ``prefect_ui``, ``mlflow``, ``dask_scheduler``,
``dask_dashboard`` when served, ``groundtruth``), ``env`` (the five variables below),
``startup_s`` (seconds per component, ``work-pool``, ``dask-workers`` and ``total``),
``doors`` (``dask_tls``: the three paths or null, ``mlflow_basic_auth``: the admin's
name or null, ``prefect_auth_string``: true or false),
``postgres`` (port, user, data_dir, databases; ``password`` off loopback) and
``components`` (per process: name, pid, ticks, url, log, pid_file, startup_s,
stop_signal, group).

``up`` prints, and ``pipetune stack env`` prints as ``export`` lines for ``eval``:
``PREFECT_API_URL``, ``MLFLOW_TRACKING_URI``, ``PIPETUNE_DASK_ADDRESS``,
``PIPETUNE_GROUNDTRUTH`` (a ``postgresql://`` URL of the ``pipetune`` database) and
``PIPETUNE_CHECKPOINTS=mlflow`` (studies keep their checkpoints as artifacts of their
MLflow run, through the tracking server's artifact proxy); with TLS on Dask, the three
``PIPETUNE_DASK_TLS_*`` too.
``down`` stops the components in reverse order, SIGTERM (PostgreSQL: SIGINT, a fast
shutdown), SIGKILL after a grace; the data stays and a later ``up`` reuses it and, when
they are free, the same ports. ``status`` lists each component, its PID, alive or not,
and its URL.

This package starts Prefect, MLflow and Dask as command lines; it never imports
Prefect (import-linter), only ``distributed.Client`` to count the workers. Modules:
:mod:`~pipetune.stack.state` (``stack.json``, ``status``, ``env``),
:mod:`~pipetune.stack.components` (launching each component),
:mod:`~pipetune.stack.probes` (health checks, the Prefect API calls),
:mod:`~pipetune.stack.lifecycle` (``up`` and ``down``: the order),
:mod:`~pipetune.stack.postgres` and :mod:`~pipetune.stack._proc` (detached processes).
"""

from __future__ import annotations

from pipetune.stack.lifecycle import down, up
from pipetune.stack.postgres import Postgres
from pipetune.stack.state import (
    DATABASES,
    ENV_KEYS,
    STACK_FILE,
    WORK_POOL,
    ComponentStatus,
    default_dir,
    env,
    env_lines,
    load,
    running,
    status,
)

__all__ = [
    "DATABASES",
    "ENV_KEYS",
    "STACK_FILE",
    "WORK_POOL",
    "ComponentStatus",
    "Postgres",
    "default_dir",
    "down",
    "env",
    "env_lines",
    "load",
    "running",
    "status",
    "up",
]
