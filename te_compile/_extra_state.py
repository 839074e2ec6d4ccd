"""Transformer Engine's ``transformer_engine.pytorch._extra_state`` name that user code reads.

TE keeps a module's quantisation state in a pickled ``_extra_state`` and refuses to unpickle it
unless the environment variable named by ``UNSAFE_PICKLE_EXTRA_STATE_ENV`` is set. Here the
state is tensors (``fp8_meta.*`` buffers of the state_dict), nothing is pickled, and the
variable changes nothing; the name exists so that code (TE's own checkpoint tests) which sets
and restores the variable around ``load_state_dict`` runs unchanged.
"""

__all__ = ["UNSAFE_PICKLE_EXTRA_STATE_ENV"]

UNSAFE_PICKLE_EXTRA_STATE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
