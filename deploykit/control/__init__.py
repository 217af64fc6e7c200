"""Layer 7: desired against actual, in three subpackages: ``revisions`` (decide, then act; the state
store), ``budget`` (the host as a budget) and ``live`` (deployments held in this process, each changed by
one worker, over the other two). Never imports torch at module import."""
