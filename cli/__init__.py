"""The ``rl-controller`` command line: the top layer.

Every command module lives here (``main`` mounts them), so the packages below --
``events``, ``workers``, ``controller``, ``replay``, ``sim`` -- never import a command.
"""
