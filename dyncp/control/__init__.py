"""The control plane: what makes every rank run the same, authentic plan, and name a failure.

Modules:
``signing`` (signed plan records, torch-free),
``namespace`` (the job's ``dyncp/<prefix>/`` keys and the one prefix check, torch-free),
``failures`` (the failure board naming the failing rank through the Store),
``agreement`` (the per-step plan-digest comparison, one all_reduce),
``model_channel`` (cost-model versions and measurements through the Store),
``job`` (the job's collective timeout, read from the default process group).
The last four use torch.distributed; import them from their modules.
"""

__all__: list[str] = []  # nothing re-exported: import from the modules (see above)
