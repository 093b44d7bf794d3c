"""The write-ahead log: with ``[server] wal = true`` an acknowledged change survives a crash.

Modules: ``records`` (segment and record bytes, checksums, the scan that finds a
torn tail), ``log`` (segment files, group commit, rotation, the size bound),
``logged_table`` and ``logged_variables`` (a table, and the named variables, that log their
changes before answering), ``replay``
(restore = checkpoint + log). docs/durability.md states the promise and the rules.
"""
