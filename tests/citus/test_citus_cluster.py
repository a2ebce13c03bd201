"""The Citus cluster harness itself: a coordinator and two workers that really distribute.

A table distributed on the coordinator gets shards on the workers only; a row inserted
through the coordinator is found, by direct query, on the one worker holding its shard and
on no other node.
"""

from __future__ import annotations

import psycopg

from citus_cluster import CITUS_VERSION, CitusCluster


def test_cluster_runs_the_expected_citus(citus_cluster: CitusCluster, citus_db: str) -> None:
    with psycopg.connect(citus_db) as conn:
        version = conn.execute(
            "SELECT extversion FROM pg_extension WHERE extname = 'citus'").fetchone()
        nodes = conn.execute(
            "SELECT nodeport, groupid = 0, shouldhaveshards FROM pg_dist_node"
            " WHERE isactive ORDER BY groupid").fetchall()
        release = conn.execute("SELECT citus_version()").fetchone()
    assert version is not None
    assert release is not None and f"Citus {CITUS_VERSION[citus_cluster.flavour]}" in release[0]
    assert nodes == [(citus_cluster.coordinator.port, True, False)] + [
        (w.port, False, True) for w in citus_cluster.workers]


def test_row_lives_on_the_worker_holding_its_shard(citus_cluster: CitusCluster,
                                                   citus_db: str) -> None:
    db = citus_db.rsplit("/", 1)[1]
    with psycopg.connect(citus_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (account text, amount bigint)")
        conn.execute("SELECT create_distributed_table('ledger', 'account', shard_count => 4)")
        conn.execute("INSERT INTO ledger VALUES ('acct-1', 10), ('acct-1', 5), ('acct-2', 7)")
        shard, port = conn.execute(
            "SELECT s.shard_name, s.nodeport FROM citus_shards s"
            " WHERE s.shardid = get_shard_id_for_distribution_column('ledger', 'acct-1')"
        ).fetchone()  # type: ignore[misc]
        placements = conn.execute(
            "SELECT DISTINCT nodeport FROM citus_shards WHERE table_name = 'ledger'::regclass"
        ).fetchall()
        total = conn.execute("SELECT count(*), sum(amount) FROM ledger").fetchone()
    assert total == (3, 22)
    assert {p for (p,) in placements} <= {w.port for w in citus_cluster.workers}
    holder = next(w for w in citus_cluster.workers if w.port == port)
    others = [n for n in citus_cluster.nodes if n is not holder]
    with psycopg.connect(holder.dsn(db)) as conn:
        rows = conn.execute(
            f'SELECT count(*), sum(amount) FROM "{shard}" WHERE account = %s', ("acct-1",)
        ).fetchone()
    assert rows == (2, 15)
    for node in others:  # the shard table exists on its worker only
        with psycopg.connect(node.dsn(db)) as conn:
            found = conn.execute("SELECT to_regclass(%s)", (shard,)).fetchone()
        assert found == (None,), f"{shard} on port {node.port}"
