"""Live deployments in this process: the ``Deployment`` facade, its typed state (``machine``) and the one
thread that changes it (``worker``), its generations (``pool``), rollouts, loads on demand, reload records,
the watcher, ownership of names and the ``Supervisor`` of a manifest directory. Builds on the revisions
and the budget; neither knows it."""
