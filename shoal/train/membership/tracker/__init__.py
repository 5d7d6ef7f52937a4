"""What a worker's loop calls under ``--elastic``: the start of an epoch, whether steps are
left, a step, its end, a change, its state for a checkpoint.

- :mod:`~shoal.train.membership.tracker.process_group`: a job whose workers meet in one
  process group (``sync``, the periodic strategies): :class:`Elastic`; its joins at a
  meeting: :mod:`~shoal.train.membership.tracker.joins`;
- :mod:`~shoal.train.membership.tracker.detached`: a parameter server's worker:
  :class:`AsyncElastic`; server 0's deals as it takes them:
  :mod:`~shoal.train.membership.tracker.deals`;
- :mod:`~shoal.train.membership.tracker.compute_group`: a compute group (``groups``)
  re-formed in place.
"""
