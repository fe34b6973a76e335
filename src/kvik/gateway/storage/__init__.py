"""Key and usage storage: SQLite by default, PostgreSQL for shared deployments, one schema."""

from kvik.gateway.storage.database import Database, open_database

__all__ = ["Database", "open_database"]
