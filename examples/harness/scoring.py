"""The verifier of agent.py's sessions (consumer.yaml: `verifier: scoring:verify`)."""


def verify(task, output):
    """The reward in [0, 1]. `output` is what the harness printed (a command harness's output
    is its stdout, stripped: a string), or None when it crashed (exited non-zero)."""
    if output is None:
        return 0.0
    return 1.0 if output == task.payload["answer"] else 0.0
