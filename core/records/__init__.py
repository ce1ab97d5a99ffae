"""Every measurement as it is made: the record store (SQLite or PostgreSQL), its SQL connection,
and the fleet that splits a model's tasks between devices sharing one store."""
