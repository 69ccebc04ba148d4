"""The Orchid demo's feature definitions (``feast apply`` reads this module).

One entity, ``user`` (join key ``user_id``, Int64), and two versions of the same view over one
source, each behind a feature service tagged with its ``definition_version``:

* ``user_stats_v12`` / ``ranker_v12``: the version the ``ranker-v3`` model was built against;
* ``user_stats_v13`` / ``ranker_v13``: the same fields under a newer definition version, so a
  test can show a route bound to v12 refusing v13.

Fields (all three views): ``score`` Float32, ``clicks`` Int64, ``risk`` Float32. Served with
``full_feature_names`` they read ``user_stats_v12__score`` etc. The values generate.py writes
encode the user and the snapshot (see its docstring).
"""

from datetime import timedelta

from feast import Entity, FeatureService, FeatureView, Field, FileSource, ValueType
from feast.types import Float32, Int64

user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.INT64, description="A ranked user")

users_source = FileSource(
    name="users_parquet",
    path="data/users.parquet",
    timestamp_field="event_timestamp",
    created_timestamp_column="created",
)

_SCHEMA = [
    Field(name="score", dtype=Float32),
    Field(name="clicks", dtype=Int64),
    Field(name="risk", dtype=Float32),
]

user_stats_v12 = FeatureView(
    name="user_stats_v12",
    entities=[user],
    ttl=timedelta(days=1),
    schema=list(_SCHEMA),
    source=users_source,
    online=True,
    tags={"definition_version": "v12"},
)

user_stats_v13 = FeatureView(
    name="user_stats_v13",
    entities=[user],
    ttl=timedelta(days=1),
    schema=list(_SCHEMA),
    source=users_source,
    online=True,
    tags={"definition_version": "v13"},
)

ranker_v12 = FeatureService(name="ranker_v12", features=[user_stats_v12], tags={"definition_version": "v12"})
ranker_v13 = FeatureService(name="ranker_v13", features=[user_stats_v13], tags={"definition_version": "v13"})
