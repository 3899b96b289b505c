"""Storage adapters: the one place that imports sqlmodel and SQLAlchemy."""
