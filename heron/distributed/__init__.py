"""Tensor parallelism over ``torch.distributed``: the group a model shards over and its
collectives are ``heron.parallel``), the rendezvous of the ranks (``rendezvous``), the rank-0 runner
that drives the workers (``executor``) and the workers' loop (``worker``)."""
