"""Choosing where a request runs: the routing policy shared by data-parallel serving
(``loom serve --data-parallel-size``) and the standalone router (``loom router``)."""
