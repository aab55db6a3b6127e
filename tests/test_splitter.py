"""flows.Splitter: which planes the coflow gives other ranks' flows, and what
that does to this rank's own split (pure: no planes are opened)."""
from mpccs.algorithms import build_schedule
from mpccs.algorithms.overlap import companion_flows
from mpccs.algorithms.schedule import Flow, Topology
from mpccs.control import ControlConfig, FlowDemand, PathController
from mpccs.flows import Splitter
from mpccs.windows import OUT, UP

MiB = 1 << 20


class Reach:
    """A plane as the splitter sees it: the peers it reaches from this rank."""

    completion_means_delivery = True

    def __init__(self, peers):
        self.peers = set(peers)

    def reaches(self, peer):
        return peer in self.peers


class Recording(PathController):
    """A real controller that keeps the demands it was asked to split."""

    def decide(self, flows, now, **kw):
        self.demands = {f.flow_id: f for f in flows}
        return super().decide(flows, now, **kw)


def flow(fid, src, dst, nbytes=8 * MiB):
    return Flow(fid, src, dst, "in", 0, "out", 0, nbytes // 4), nbytes


def intra_domain_stage(same_domain):
    """Rank 0 of two domains of two (0, 1 | 2, 3): the intra-domain reduce-scatter
    of a hierarchical all_reduce, each rank sending 8 MiB to its domain peer."""
    topo = Topology((0, 0, 1, 1))
    ctl = Recording(ControlConfig(), rank=0)
    planes = {UP: Reach({1}), OUT: Reach({1, 2, 3})}
    splitter = Splitter("adaptive", planes, {UP: 1 * MiB, OUT: 1 * MiB}, ctl,
                        same_domain=topo.same_domain if same_domain else None)
    mine = [flow(0, 0, 1)]
    others = (flow(1, 1, 0), flow(2, 2, 3), flow(3, 3, 2))
    plan = splitter.plan(mine, now=0.0, chunk_bytes=512 * 1024, others=others)
    return ctl.demands, plan


def test_up_runs_inside_every_domain_in_the_coflow_and_the_own_flow_splits():
    demands, plan = intra_domain_stage(same_domain=True)
    assert demands[2].planes == (UP, OUT) and demands[3].planes == (UP, OUT)
    assert demands[1].planes == (UP, OUT)
    # Every domain's stage takes as long as this one's: the own flow is on the
    # critical path and gets its share of 'out' (priors 5 and 0.7 GB/s: ~12%).
    out = 8 * MiB - plan.splits[0].boundary_bytes
    assert 0.06 * 8 * MiB < out < 0.2 * 8 * MiB


def test_without_the_topology_the_other_domain_looks_out_only_and_critical():
    # What the coflow saw before: 'up' does not reach ranks 2 and 3 from here,
    # so their flows went on 'out' alone, their domain looked critical, and
    # this rank's flow (with slack) stayed whole on 'up'.
    demands, plan = intra_domain_stage(same_domain=False)
    assert demands[2].planes == (OUT,)
    assert plan.splits[0].boundary_bytes == 8 * MiB


def test_a_severed_peer_in_this_domain_keeps_its_flows_off_up():
    topo = Topology((0, 0, 1, 1))
    ctl = Recording(ControlConfig(), rank=0)
    planes = {UP: Reach(()), OUT: Reach({1, 2, 3})}  # 'up' to rank 1 is gone
    splitter = Splitter("adaptive", planes, {UP: 1 * MiB, OUT: 1 * MiB}, ctl, same_domain=topo.same_domain)
    splitter.plan([flow(0, 0, 2)], now=0.0, chunk_bytes=512 * 1024, others=(flow(1, 1, 0), flow(2, 2, 3)))
    assert ctl.demands[1].planes == (OUT,)
    assert ctl.demands[2].planes == (UP, OUT)
    assert ctl.demands[0].planes == (OUT,)  # across domains: 'out' only


def plan_rank0_intra_stage(collective, count, channels, rate, with_companions, ctl=None, quantum=0):
    """Rank 0's first intra-domain stage of a hierarchical schedule (``count`` float32 elements,
    as build_schedule reads it) on two domains of two, planned by an adaptive splitter from
    ``rate`` priors (or by ``ctl``, a controller that planned before), every flow in chunks of
    ``quantum`` bytes (0: no chunks): (controller, plan, rank 0's flows with their bytes)."""
    topo = Topology((0, 0, 1, 1))
    schedule = build_schedule(collective, 4, count, algorithm="hierarchical", topology=topo, channels=channels)
    stage = next(s for s in schedule.stages if s.label.startswith("intra rs"))
    companions = companion_flows(schedule, topo.same_domain)[stage.id] if with_companions else ()
    ctl = ctl or Recording(ControlConfig(prior_rate_Bps=rate, prior_delay_s={UP: 1e-4, OUT: 1e-4}), rank=0)
    splitter = Splitter("adaptive", {UP: Reach({1}), OUT: Reach({1, 2, 3})}, {UP: MiB, OUT: MiB}, ctl,
                        same_domain=topo.same_domain)
    sized = [(f, f.count * 4) for f in stage.flows]
    mine = [x for x in sized if x[0].src == 0]
    plan = splitter.plan(mine, now=0.0, chunk_bytes=512 * 1024, others=tuple(x for x in sized if x[0].src != 0),
                         companions=tuple((f, f.count * 4) for f in companions),
                         quantum_of=(lambda f: quantum) if quantum else None)
    return ctl, plan, mine


def pipelined_intra_stage(with_companions):
    """Rank 0's intra-domain flow in a 4-channel hierarchical all_reduce on two
    domains of two, both planes priced alike (1:1): the other channels send half
    as many bytes across domains as each intra-domain stage sends inside."""
    ctl, plan, mine = plan_rank0_intra_stage("all_reduce", 16 * MiB, 4, {UP: 100e6, OUT: 100e6}, with_companions)
    nbytes = mine[0][1]
    return ctl.demands, plan, (nbytes - plan.splits[mine[0][0].id].boundary_bytes) / nbytes


def test_companions_take_out_capacity_and_leave_the_stage_unjudged():
    demands, plan, out_share = pipelined_intra_stage(with_companions=True)
    companions = [d for d in demands.values() if d.companion]
    assert len(companions) == 4 and all(d.planes == (OUT,) and d.flow_id < 0 for d in companions)
    assert abs(out_share - 0.25) < 0.07  # (1 - x) n / u = (x n + n / 2) / o at u = o
    # its time is mostly its wait behind the other channels: no verdict on 'out' from it
    assert not plan.reason["ranks"]["0"]["judgeable"]
    _, plan_alone, alone = pipelined_intra_stage(with_companions=False)
    assert abs(alone - 0.5) < 0.07  # as if 'out' were free
    assert plan_alone.reason["ranks"]["0"]["judgeable"]


def test_a_split_rounds_to_the_whole_chunk_that_finishes_first_beside_the_other_channels():
    # A 16 MiB all_reduce on 8 channels (2x2, 1:1): rank 0's in-domain flow is 1 MiB in 256 KiB
    # chunks, beside another channel's 512 KiB cross-domain flow on 'out', where ~22% on 'out'
    # finishes both together. After a stage without that load (the flow alone: 50%), the share
    # steps down by max_step to 30%, between 256 and 512 KiB on 'out'. Timed on the flow's own
    # links, 512 KiB (both planes 8.4 ms) beat 256 KiB ('up' 12.6 ms) and the split stayed at
    # 50%; on the sender's ports 512 KiB keeps 'out' busy for 16.8 ms.
    rates = {UP: 62.5e6, OUT: 62.5e6}
    chunk = 256 * 1024
    ctl, plan, mine = plan_rank0_intra_stage("all_reduce", 4 * MiB, 8, rates, False, quantum=chunk)
    flow_id, nbytes = mine[0][0].id, mine[0][1]
    assert nbytes == MiB and nbytes - plan.splits[flow_id].boundary_bytes == 512 * 1024
    _, plan, _ = plan_rank0_intra_stage("all_reduce", 4 * MiB, 8, rates, True, ctl=ctl, quantum=chunk)
    assert nbytes - plan.splits[flow_id].boundary_bytes == 256 * 1024


def test_small_flows_split_together_where_their_sender_sends_enough_in_the_stage():
    # A 16 MiB hierarchical reduce_scatter on 8 channels (2x2): each in-domain stage sends two
    # 512 KiB flows, each under min_multipath_bytes, 1 MiB together on the sender's ports. Held
    # against each flow, the threshold kept both on 'up' (testbed 0.99x 'up', where a fixed 0.8
    # split reads 1.30x); held against the sender's stage they split like one 1 MiB flow beside
    # the other channels' cross-domain load: about a quarter on 'out' at 1:1.
    ctl, plan, mine = plan_rank0_intra_stage("reduce_scatter", MiB, 8, {UP: 62.5e6, OUT: 62.5e6}, True,
                                             quantum=128 * 1024)
    assert len(mine) == 2 and all(n < ctl.config.min_multipath_bytes for _, n in mine)
    out = sum(n - plan.splits[f.id].boundary_bytes for f, n in mine)
    assert 0.1 * MiB <= out <= 0.4 * MiB, out


def test_a_small_sender_beside_other_channels_stays_on_the_configured_plane():
    # A peer that sends little in the stage (512 KiB, under min_multipath_bytes) beside its other
    # channels' cross-domain load: timed on its own 'out' looks 4x faster (a busy-span rate read
    # from buffered arrivals), but those channels load it, so the coflow keeps the peer's flow on
    # 'up' (on the testbed such flows had all gone to 'out', 1.5x 'up' alone); without the load the
    # faster plane alone takes it.
    def peer_out(with_companion):
        ctl = PathController(ControlConfig(prior_rate_Bps={UP: 62.5e6, OUT: 250e6},
                                           prior_delay_s={UP: 1e-4, OUT: 1e-4}), rank=0)
        flows = [FlowDemand(0, 0, 1, 2 * MiB, (UP, OUT)), FlowDemand(1, 2, 3, MiB // 2, (UP, OUT))]
        if with_companion:
            flows += [FlowDemand(-1, 2, 0, MiB // 2, (OUT,), companion=True)]
        decision = ctl.decide(flows, now=0.0)
        return MiB // 2 - decision.up_bytes[1]

    assert peer_out(with_companion=True) == 0
    assert peer_out(with_companion=False) == MiB // 2


def test_a_peers_flow_is_predicted_on_its_own_whole_chunks():
    # Each rank's split lands on whole chunks of its sender's chunking; the coflow
    # must predict a peer's flow the same way, or the stage time it reports is the
    # unaligned optimum's.
    chunk = 512 * 1024
    ctl = Recording(ControlConfig(), rank=0)
    splitter = Splitter("adaptive", {UP: Reach({1}), OUT: Reach({1})}, {UP: MiB, OUT: MiB}, ctl)
    plan = splitter.plan([flow(0, 0, 1)], now=0.0, chunk_bytes=chunk, others=(flow(1, 1, 0),),
                         quantum_of=lambda f: chunk)
    assert ctl.demands[1].quantum_bytes == chunk
    for rank in ("0", "1"):
        out = plan.reason["ranks"][rank]["bytes"]["out"]
        assert 0 < out < 8 * MiB and out % chunk == 0, (rank, out)


def rank0_out_bytes(flows, reported=None, rates=None, pipelined_at=None):
    """Bytes of rank 0's flow 0 on 'out', as rank 0's controller splits ``flows`` from
    ``rates`` priors (per plane) and paths ``reported`` by their receivers, with
    ``pipelined_at`` as its split_pipelined_at rates."""
    rates = rates or {UP: 100e6, OUT: 100e6}
    ctl = PathController(ControlConfig(prior_rate_Bps=rates, prior_delay_s={UP: 1e-4, OUT: 1e-4}), rank=0)
    ctl.split_pipelined_at(pipelined_at)
    for reporter, entries in (reported or {}).items():
        ctl.estimator.set_remote(reporter, entries)
    flow0 = next(f for f in flows if f.flow_id == 0)
    return flow0.nbytes - ctl.decide(flows, now=0.0).up_bytes[0]


def test_in_a_pipelined_schedule_a_rank_off_the_critical_path_splits_for_its_own_balance():
    # Rank 2 sends twice as much, so the coflow makes it critical. Alone in its stage (one
    # channel), rank 0 fills 'up' up to that stage time (less coflow_slack) and borrows
    # little: the stage ends with rank 2 anyway. Beside other channels' cross-domain load
    # (companions) its stages overlap theirs, and bytes it moves to 'up' stay on its 'up' port
    # for the whole operation: on the 2x2 testbed (1 / 1 Gbit/s) rank 1's view of rank 3's 'up'
    # held a plan-rate prior (no report of that path reached it: 108 MB/s against 136 measured),
    # so rank 1 aimed its 64 MiB in-domain splits, and those it predicted for ranks 0 and 2, at
    # 1-16% on 'out' against a balance of ~23%, and the operation took as long as with a fixed
    # 0.85 split.
    inside = [FlowDemand(0, 0, 1, 2 * MiB, (UP, OUT)), FlowDemand(1, 2, 3, 4 * MiB, (UP, OUT))]
    assert rank0_out_bytes(inside) < 128 * 1024
    beside = [FlowDemand(-1, 0, 2, MiB, (OUT,), companion=True), FlowDemand(-2, 2, 0, 2 * MiB, (OUT,), companion=True)]
    # (1 - x) n / u = (x n + P) / o at u = o, P = n / 2: x = 1/4
    assert abs(rank0_out_bytes(inside + beside) - MiB // 2) <= 4096


def test_a_whole_chunk_boundary_times_the_load_beside_on_the_port_and_the_flow_on_its_path():
    # Rank 0's in-domain path on 'out' reads half its port (the receiver's link also takes a
    # cross-domain flow); the port carries the cross-domain load at its own rate. The target
    # (~22% of 2 MiB on 'out') lies between one and two 256 KiB chunks: two finish first ('out'
    # 13.2 ms on the port, the flow's 512 KiB 8.8 ms on its path, 'up' 12.2; one chunk: 'up'
    # 14.2). Timed with the path's rate for the port's 1.5 MiB, two chunks looked 26 ms and the
    # split kept one.
    flows = [FlowDemand(0, 0, 1, 2 * MiB, (UP, OUT), quantum_bytes=256 * 1024),
             FlowDemand(-1, 0, 2, MiB, (OUT,), companion=True)]
    reported = {1: {(0, UP, 1): (130e6, 1e-4, 0), (0, OUT, 1): (60e6, 1e-4, 0)},
                2: {(0, OUT, 2): (120e6, 1e-4, 0)}}
    assert rank0_out_bytes(flows, reported) == 512 * 1024


def test_a_plane_the_model_gives_bytes_keeps_one_whole_chunk():
    # 'out' read low (76 MB/s against 127 on 'up') beside a cross-domain companion: the target,
    # ~6% of 2 MiB, is about half a 256 KiB chunk, and timed, none finishes first. Rounded to
    # none, the path would get no samples to correct that reading; one chunk keeps it measured.
    flows = [FlowDemand(0, 0, 1, 2 * MiB, (UP, OUT), quantum_bytes=256 * 1024),
             FlowDemand(-1, 0, 2, MiB, (OUT,), companion=True)]
    rates = {UP: 127e6, OUT: 76e6}
    assert rank0_out_bytes(flows, rates=rates) == 256 * 1024
    # where the model itself gives 'out' nothing, nothing goes there
    slow = {UP: 127e6, OUT: 20e6}
    assert rank0_out_bytes(flows, rates=slow) == 0


def test_pipelined_stages_split_at_the_rates_the_ranks_agreed_and_other_stages_at_the_estimates():
    # Every path of rank 0 and of its domain peer reads 'out' at 90 MB/s (125 shaped: a plane a
    # pipelined operation does not keep busy reads low) and 'up' at 125.
    reported = {1: {(0, UP, 1): (125e6, 1e-4, 0), (0, OUT, 1): (90e6, 1e-4, 0)},
                0: {(1, UP, 0): (125e6, 1e-4, 0), (1, OUT, 0): (90e6, 1e-4, 0)}}
    agreed = {UP: 125e6, OUT: 125e6}
    pipelined = [FlowDemand(0, 0, 1, 2 * MiB, (UP, OUT), quantum_bytes=256 * 1024),
                 FlowDemand(1, 1, 0, 2 * MiB, (UP, OUT), quantum_bytes=256 * 1024),
                 FlowDemand(-1, 0, 2, MiB, (OUT,), companion=True), FlowDemand(-2, 1, 3, MiB, (OUT,), companion=True)]
    assert rank0_out_bytes(pipelined, reported) == 256 * 1024  # ~13% at the estimates: one chunk
    assert rank0_out_bytes(pipelined, reported, pipelined_at=agreed) == 512 * 1024  # 1/4 at 1:1
    alone = pipelined[:2]  # one channel: the stage has the planes to itself
    # 90 / (125 + 90) of 2 MiB, to whole chunks: the agreed rates do not apply
    assert rank0_out_bytes(alone, reported, pipelined_at=agreed) == 768 * 1024
