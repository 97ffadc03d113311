"""``rl-controller dashboard``: a read-only live web page of the runs in a store."""
