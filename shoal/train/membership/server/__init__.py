"""Server 0's side of an asynchronous ``--elastic`` job, driven by the reports it takes.

- :mod:`~shoal.train.membership.server.members`: the reports of membership (a share taken,
  a part given, idle, joined, leaving, a lost member's rows, a new leader), a lost worker,
  the join desk, the checkpoint's part and its resume;
- :mod:`~shoal.train.membership.server.dealer`: every worker's schedule as server 0 keeps
  it, a lost worker's rest dealt, a joiner's part given, the release;
- :mod:`~shoal.train.membership.server.followers`: the other servers, told what server 0
  decides.
"""
