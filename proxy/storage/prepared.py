"""The writer thread's statements run on the driver's cursor (`Prepared`): each compiled once for its rows' columns,
its rows bound as SQLAlchemy binds them (`construct_params`, then each type's bind processor: JSON's serializer,
SQLite's booleans), then `execute` or `executemany` on the DBAPI cursor of the writer's connection.

`Connection.execute` costs about twice what the database does for a turn's small writes (its execution context,
result object and cache look-up a statement); this is the part of it that a plain INSERT or UPDATE needs. A
statement that needs more (a Python-side default, RETURNING, an expanding IN, rows with different columns, several
rows where the dialect sends them as one multi-VALUES statement, a connection with a schema map, or one past the few
hundred statements already compiled) runs through `Connection.execute` as before. Engine events
(`before_cursor_execute`, echo) do not see the statements run here. A driver's error is raised as SQLAlchemy raises
it (`DBAPIError.instance`: `IntegrityError` for a key taken first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Executable
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.dml import UpdateBase

_MOST = 256  # statements compiled here; past it, a new one runs through `Connection.execute`


@dataclass(frozen=True, slots=True)
class _Compiled:
    statement: Executable  # held so that its id is not reused while it is a key
    compiled: SQLCompiler
    string: str
    positions: tuple[str, ...] | None  # a positional driver's parameters, in order
    names: dict[str, str]  # a named driver's escaped parameter names
    processors: dict[str, Any]


class Prepared:
    """Runs the writer's statements on its connection's DBAPI cursor, each compiled once per dialect and columns."""

    def __init__(self, dialect: Dialect) -> None:
        self._dialect = dialect
        self._compiled: dict[tuple[int, tuple[str, ...]], _Compiled | None] = {}

    def execute(self, conn: Connection, statement: Executable, rows: list[dict[str, Any]]) -> None:
        keys = tuple(rows[0]) if rows else ()
        compiled = self._for(statement, keys) if rows else None
        if (
            compiled is None
            or any(row.keys() != rows[0].keys() for row in rows[1:])
            or (len(rows) > 1 and self._dialect.use_insertmanyvalues_wo_returning)  # one multi-VALUES statement
            or "schema_translate_map" in conn.get_execution_options()
        ):
            conn.execute(statement, rows)
            return
        bound = [self._bound(compiled, row) for row in rows]
        dbapi_connection = conn.connection.dbapi_connection
        assert dbapi_connection is not None
        cursor = None
        try:
            cursor = dbapi_connection.cursor()
            if len(bound) == 1:
                cursor.execute(compiled.string, bound[0])
            else:
                cursor.executemany(compiled.string, bound)
        except self._dialect.loaded_dbapi.Error as e:
            dropped = self._dialect.is_disconnect(e, dbapi_connection, cursor)
            if dropped:  # as `Connection.execute` does: the pool makes a new one, the transaction only rolls back
                conn.invalidate(e)
            raise DBAPIError.instance(
                compiled.string,
                bound,
                e,
                self._dialect.loaded_dbapi.Error,
                hide_parameters=True,
                connection_invalidated=dropped,
                dialect=self._dialect,
                ismulti=len(bound) > 1,
            ) from e
        finally:
            if cursor is not None:
                cursor.close()

    def _for(self, statement: Executable, keys: tuple[str, ...]) -> _Compiled | None:
        key = (id(statement), keys)
        if key in self._compiled:
            found = self._compiled[key]
            if found is None or found.statement is statement:
                return found
        if len(self._compiled) >= _MOST:
            return None
        made = self._compile(statement, keys)
        self._compiled[key] = made
        return made

    def _compile(self, statement: Executable, keys: tuple[str, ...]) -> _Compiled | None:
        # Two of what this reads are SQLAlchemy's own attributes, not its API: a version without them runs every
        # statement through `Connection.execute` (tests/test_writer_prepared.py says which path the store takes).
        if not isinstance(statement, UpdateBase) or getattr(statement, "_returning", True):
            return None
        compiled = statement.compile(dialect=self._dialect, column_keys=list(keys))
        assert isinstance(compiled, SQLCompiler)
        processors = getattr(compiled, "_bind_processors", None)
        if (
            processors is None
            or compiled.insert_prefetch
            or compiled.update_prefetch
            or compiled.implicit_returning
            or compiled.literal_execute_params
            or compiled.post_compile_params
            or compiled.schema_translate_map
        ):
            return None
        return _Compiled(
            statement,
            compiled,
            compiled.string,
            tuple(compiled.positiontup) if compiled.positional and compiled.positiontup is not None else None,
            dict(compiled.escaped_bind_names),
            dict(processors),
        )

    def _bound(self, compiled: _Compiled, row: dict[str, Any]) -> Any:
        """The row's parameters as `Connection.execute` hands them to the driver."""
        params = compiled.compiled.construct_params(row, escape_names=False)
        processors = compiled.processors
        if compiled.positions is not None:
            return self._dialect.execute_sequence_format(
                [processors[key](params[key]) if key in processors else params[key] for key in compiled.positions]
            )
        names = compiled.names
        return {
            names.get(key, key): processors[key](value) if key in processors else value for key, value in params.items()
        }
