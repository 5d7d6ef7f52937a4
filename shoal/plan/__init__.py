"""Planning a run: measure candidate configurations, predict their time to a target accuracy,
pick the fastest (``shoal plan``, ``shoal train --strategy auto``), and a cost model that
predicts what cannot be run here (``shoal plan --simulate``)."""
