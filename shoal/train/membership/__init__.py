"""Elastic membership of a training job (``--elastic``): who is in the job, who trains what,
and what the run keeps of each change.

The package is organised by concept, each below the trainer (the loop calls it):

- :mod:`~shoal.train.membership.policy`: which strategy and options take ``--elastic``;
- :mod:`~shoal.train.membership.schedule`: the pure schedule of an asynchronous job
  (slots, segments, shares dealt);
- :mod:`~shoal.train.membership.resume`: where a resumed run goes on (the plan of a
  process-group job, every detached worker's schedule rebuilt);
- :mod:`~shoal.train.membership.changes`: a membership change, as ``summary.json`` and the
  checkpoints hold it;
- :mod:`~shoal.train.membership.messages`: the typed reports to server 0 and its words to the
  other servers;
- :mod:`~shoal.train.membership.samples`: ``--record-samples``' files;
- :mod:`~shoal.train.membership.handover`: a joiner's state, from a live peer;
- :mod:`~shoal.train.membership.jobfile`: where ``shoal join`` finds a job;
- :mod:`~shoal.train.membership.tracker`: what the loop calls (a process-group job's, a
  detached worker's, a compute group's);
- :mod:`~shoal.train.membership.server`: server 0's side of an asynchronous job (its dealer,
  its join desk, the servers that follow it).

Above the trainer, because they build one: ``shoal join``'s command and worker
(:mod:`shoal.train.join`), a resume on more or fewer workers (:mod:`shoal.train.resize`)
and server 0's records (:mod:`shoal.train.coordinator`).
"""
