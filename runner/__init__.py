"""The per-member runner: started by the agent in its own session, it outlives the agent.

``python -m tuneplane.runner <member_dir>`` (:mod:`.main`) reads ``member.json``
(:mod:`.member_file`), claims the launch, starts the local processes, decides with the sans-IO
:mod:`.lifecycle` and leaves ``launch.claim``, ``runner.json`` and ``exit.json`` (:mod:`.records`).
Stdlib and psutil only: this package ships inside the Job Capsule as ``runner.pyz``.
"""
