"""The engine: ``Engine`` (the user's object), ``Driver`` (the thread per rank), the tick
(``protocol``), shardgen's private process groups (``comm``, ``groups``), process-wide state
(``process``) and the driver's span recording (``timeline``)."""
