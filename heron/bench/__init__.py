"""``heron bench``: Heron's benchmarks in one harness.

``heron bench decode | throughput | serve | spec | kernel | host | profile``; each prints its
figures and, with ``--output-json PATH``, writes them with the command, commit, date, device,
versions and configuration (:mod:`heron.bench.result`). Shapes and their random-weight
checkpoints are in :mod:`heron.bench.shapes`, timers and bandwidth floors in
:mod:`heron.bench.measure`.
"""
