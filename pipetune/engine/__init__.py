"""The study engine: the one loop that runs a study, and what only it uses.

==============  ======================================================================
``study``       :class:`~pipetune.engine.study.Study`: asks the searcher for trials,
                plans each epoch (profile, probe, train) with the system tuner, sends
                epochs to a backend, hears results, asks the scheduler, ends trials
``events``      what the engine emits to its observers (the journal, the MLflow and
                Prefect records, the live table) as it acts
``trial``       a trial's state and one step's outcome
``journal``     a study's events as JSON lines, for ``--resume``
``replay``      which journaled events a resumed study replays
``one_time``    what each worker has already paid once (a compile), per graph
==============  ======================================================================

The policies it consults live beside it (:mod:`pipetune.tuner`,
:mod:`pipetune.searchers`, :mod:`pipetune.schedulers`), the epoch it sends runs in
:mod:`pipetune.runner`, and :mod:`pipetune.session` opens a study's stores and cluster
around it. Nothing here imports Prefect, Dask or MLflow.
"""
