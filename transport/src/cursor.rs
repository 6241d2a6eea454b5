//! One rank's program as a sans-I/O state machine: what to do next, and
//! whether a message that arrived is one the program expects.
//!
//! The executor ([`crate::run_rank`]) only carries out what the cursor says
//! over a [`Transport`](crate::Transport) — copy, pack and send, receive and
//! unpack, wait for receivers — so the order of a rank's work, the checks on
//! incoming messages and the byte counts live in one place that tests drive
//! without any I/O.
//!
//! Per round: local copies, then every send, then one receive per expected
//! message (in any order of arrival; each peer once), then, if the round
//! sent anything, a flush (the round's payloads are released before the
//! rank goes on, so nothing it lent is overwritten while read).
//!
//! Data planes that move a round's messages together (a communicator's
//! group, a same-device schedule) walk the same cursor a round at a time
//! through [`RoundCursor`], which hands out each round's local copies,
//! sends and receives at once; the statistics are the cursor's either way.

use reshard::{Endpoint, LocalCopy, Message, Pieces, RankProgram, RecvPiece, SendPiece};

/// What one rank did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankStats {
    /// Bytes sent (wire dtype).
    pub sent_bytes: u64,
    /// Bytes received (wire dtype).
    pub recv_bytes: u64,
    /// Messages sent.
    pub messages: u64,
}

/// What the rank does next.
#[derive(Debug)]
pub(crate) enum Action<'p> {
    /// Copy these pieces within the rank.
    Locals {
        /// The round.
        round: u32,
        /// The copies.
        copies: &'p Pieces<LocalCopy>,
    },
    /// Pack this message and send it.
    Send {
        /// The round.
        round: u32,
        /// The message.
        message: &'p Message<SendPiece>,
    },
    /// Receive one of the round's expected messages (whichever comes
    /// first), then hand its sender to [`RankCursor::arrived`].
    Recv {
        /// The round.
        round: u32,
    },
    /// Wait until receivers have released every payload of this round.
    Flush {
        /// The round.
        round: u32,
    },
    /// The program is complete.
    Done(RankStats),
}

/// Where the cursor stands within a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Locals,
    Send(usize),
    Recv,
    Flush,
}

/// A rank's progress through its program.
#[derive(Debug)]
pub(crate) struct RankCursor<'p> {
    program: &'p RankProgram,
    round: usize,
    phase: Phase,
    /// Which of the round's expected messages arrived.
    arrived: Vec<bool>,
    /// How many receives of the round are still to be asked for.
    to_receive: usize,
    stats: RankStats,
}

/// A message the program does not expect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Unexpected {
    /// The round.
    pub round: u32,
    /// The sender.
    pub peer: Endpoint,
    /// Why.
    pub problem: &'static str,
}

impl<'p> RankCursor<'p> {
    /// At the start of `program`.
    pub(crate) fn new(program: &'p RankProgram) -> RankCursor<'p> {
        let mut c = RankCursor { program, round: 0, phase: Phase::Locals, arrived: Vec::new(), to_receive: 0, stats: RankStats::default() };
        c.enter_round();
        c
    }

    fn enter_round(&mut self) {
        self.phase = Phase::Locals;
        if let Some(r) = self.program.rounds.get(self.round) {
            self.arrived = vec![false; r.recvs.len()];
            self.to_receive = r.recvs.len();
        }
    }

    /// The next action. After a [`Action::Recv`], call
    /// [`arrived`](Self::arrived) with the message's sender before asking
    /// again.
    pub(crate) fn next_action(&mut self) -> Action<'p> {
        let program = self.program;
        loop {
            let Some(r) = program.rounds.get(self.round) else {
                return Action::Done(self.stats);
            };
            let round = self.round as u32;
            match self.phase {
                Phase::Locals => {
                    self.phase = Phase::Send(0);
                    if !r.locals.is_empty() {
                        return Action::Locals { round, copies: &r.locals };
                    }
                }
                Phase::Send(i) => match r.sends.get(i) {
                    Some(message) => {
                        self.phase = Phase::Send(i + 1);
                        self.stats.sent_bytes = self.stats.sent_bytes.saturating_add(message.wire_bytes());
                        self.stats.messages += 1;
                        return Action::Send { round, message };
                    }
                    None => self.phase = Phase::Recv,
                },
                Phase::Recv => {
                    if self.to_receive > 0 {
                        self.to_receive -= 1;
                        return Action::Recv { round };
                    }
                    self.phase = Phase::Flush;
                }
                Phase::Flush => {
                    self.round += 1;
                    self.enter_round();
                    if !r.sends.is_empty() {
                        return Action::Flush { round };
                    }
                }
            }
        }
    }

    /// Every message of the current round arrived at once (a data plane
    /// that receives a round's messages together): the messages, in the
    /// program's order, or why they cannot all be expected (one peer
    /// sends twice). The round's receives are then done.
    pub(crate) fn arrived_all(&mut self) -> Result<&'p [Message<RecvPiece>], Unexpected> {
        let program = self.program;
        let recvs = program.rounds.get(self.round).map_or(&[][..], |r| &r.recvs[..]);
        for m in recvs {
            self.arrived(m.peer)?;
        }
        self.to_receive = 0;
        Ok(recvs)
    }

    /// The peers whose message of the current round has not arrived yet,
    /// in the program's order.
    pub(crate) fn awaited(&self) -> impl Iterator<Item = Endpoint> + '_ {
        let recvs = self.program.rounds.get(self.round).map_or(&[][..], |r| &r.recvs[..]);
        recvs.iter().zip(&self.arrived).filter(|(_, &got)| !got).map(|(m, _)| m.peer)
    }

    /// A message of the current round arrived from `peer`: the pieces it
    /// must carry, or why it is not expected (no message from this peer in
    /// this round, or a second one).
    pub(crate) fn arrived(&mut self, peer: Endpoint) -> Result<&'p Message<RecvPiece>, Unexpected> {
        let round = self.round as u32;
        let program = self.program;
        let r = program.rounds.get(self.round).ok_or(Unexpected { round, peer, problem: "the program is complete" })?;
        let i =
            r.recvs.iter().position(|m| m.peer == peer).ok_or(Unexpected { round, peer, problem: "no message expected from this peer" })?;
        if std::mem::replace(&mut self.arrived[i], true) {
            return Err(Unexpected { round, peer, problem: "second message in one round" });
        }
        self.stats.recv_bytes = self.stats.recv_bytes.saturating_add(r.recvs[i].wire_bytes());
        Ok(&r.recvs[i])
    }
}

/// One round of a rank's program, handed out at once: what a data plane
/// that moves a round's messages together does per round, in order (local
/// copies, then the exchange of `sends` and `recvs`).
#[derive(Debug)]
pub(crate) struct Round<'p> {
    /// The round.
    pub round: u32,
    /// Copies within the rank.
    pub locals: Option<&'p Pieces<LocalCopy>>,
    /// Messages to send, in the program's order.
    pub sends: Vec<&'p Message<SendPiece>>,
    /// Messages to receive, in the program's order.
    pub recvs: &'p [Message<RecvPiece>],
}

/// A [`RankCursor`] walked a round at a time. Rounds in which the rank has
/// nothing to do are skipped.
#[derive(Debug)]
pub(crate) struct RoundCursor<'p> {
    cursor: RankCursor<'p>,
    /// An action of the next round, taken while finding the end of this one.
    ahead: Option<Action<'p>>,
    stats: Option<RankStats>,
}

impl<'p> RoundCursor<'p> {
    /// At the start of `program`.
    pub(crate) fn new(program: &'p RankProgram) -> RoundCursor<'p> {
        RoundCursor { cursor: RankCursor::new(program), ahead: None, stats: None }
    }

    /// The next round with work, or `None` when the program is complete
    /// (then [`stats`](Self::stats) holds what it moved). An error where a
    /// round expects two messages from one peer.
    pub(crate) fn next_round(&mut self) -> Result<Option<Round<'p>>, Unexpected> {
        let mut current: Option<Round<'p>> = None;
        loop {
            let action = match self.ahead.take() {
                Some(a) => a,
                None => self.cursor.next_action(),
            };
            let round = match &action {
                Action::Locals { round, .. } | Action::Send { round, .. } | Action::Recv { round } | Action::Flush { round } => *round,
                Action::Done(stats) => {
                    self.stats = Some(*stats);
                    return Ok(current);
                }
            };
            if current.as_ref().is_some_and(|c| c.round != round) {
                self.ahead = Some(action);
                return Ok(current);
            }
            let c = current.get_or_insert_with(|| Round { round, locals: None, sends: Vec::new(), recvs: &[] });
            match action {
                Action::Locals { copies, .. } => c.locals = Some(copies),
                Action::Send { message, .. } => c.sends.push(message),
                Action::Recv { .. } => c.recvs = self.cursor.arrived_all()?,
                Action::Flush { .. } | Action::Done(_) => {}
            }
        }
    }

    /// What the program moved, once [`next_round`](Self::next_round)
    /// returned `None`.
    pub(crate) fn stats(&self) -> Option<RankStats> {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard::{parse_layout, plan_reshard, PlanOptions};

    /// Walks a cursor, answering every receive with the expected senders in
    /// order; returns the actions as short strings.
    fn walk(program: &RankProgram) -> Vec<String> {
        let mut c = RankCursor::new(program);
        let mut out = Vec::new();
        let mut pending: Vec<Endpoint> = Vec::new();
        loop {
            match c.next_action() {
                Action::Locals { round, copies } => out.push(format!("r{round} locals {}", copies.len())),
                Action::Send { round, message } => out.push(format!("r{round} send {}", message.peer)),
                Action::Recv { round } => {
                    if pending.is_empty() {
                        pending = program.rounds[round as usize].recvs.iter().rev().map(|m| m.peer).collect();
                    }
                    let peer = pending.pop().expect("a receive the program expects");
                    c.arrived(peer).expect("expected");
                    out.push(format!("r{round} recv {peer}"));
                }
                Action::Flush { round } => out.push(format!("r{round} flush")),
                Action::Done(stats) => {
                    let sent: u64 = program.rounds.iter().flat_map(|r| &r.sends).map(|m| m.wire_bytes()).sum();
                    let recv: u64 = program.rounds.iter().flat_map(|r| &r.recvs).map(|m| m.wire_bytes()).sum();
                    assert_eq!((stats.sent_bytes, stats.recv_bytes), (sent, recv));
                    return out;
                }
            }
        }
    }

    fn programs() -> Vec<RankProgram> {
        let src = parse_layout(
            r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [8, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
        )
        .unwrap();
        let dst = parse_layout(
            r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [{"name": "w", "dtype": "bf16", "shape": [8, 4], "mesh": {"shape": [4]}, "placements": ["replicate"]}]}"#,
        )
        .unwrap();
        let plan = plan_reshard(&src, &dst, &PlanOptions { max_staging_bytes: 32, ..PlanOptions::default() }).unwrap();
        plan.programs(&src, &dst).unwrap()
    }

    #[test]
    fn every_rank_walks_its_rounds_in_order() {
        for p in programs() {
            let steps = walk(&p);
            // Every send and receive of the program, each once, round by
            // round, sends before receives, a flush after a round that sent.
            for (i, r) in p.rounds.iter().enumerate() {
                let mine: Vec<&String> = steps.iter().filter(|s| s.starts_with(&format!("r{i} "))).collect();
                let sends = mine.iter().filter(|s| s.contains(" send ")).count();
                let recvs = mine.iter().filter(|s| s.contains(" recv ")).count();
                assert_eq!((sends, recvs), (r.sends.len(), r.recvs.len()), "{}: round {i}: {mine:?}", p.endpoint);
                let flushes = mine.iter().filter(|s| s.ends_with(" flush")).count();
                assert_eq!(flushes, usize::from(!r.sends.is_empty()), "{mine:?}");
                if let (Some(last_send), Some(first_recv)) =
                    (mine.iter().rposition(|s| s.contains(" send ")), mine.iter().position(|s| s.contains(" recv ")))
                {
                    assert!(last_send < first_recv, "{mine:?}");
                }
            }
        }
    }

    #[test]
    fn a_round_cursor_hands_out_every_round_with_work_once() {
        for p in programs() {
            let mut c = RoundCursor::new(&p);
            let mut seen = Vec::new();
            while let Some(r) = c.next_round().expect("a valid program") {
                let want = &p.rounds[r.round as usize];
                assert_eq!(r.sends.len(), want.sends.len());
                assert_eq!(r.recvs.len(), want.recvs.len());
                assert_eq!(r.locals.map_or(0, |l| l.len()), want.locals.len());
                seen.push(r.round);
            }
            let busy: Vec<u32> = (0..p.rounds.len() as u32)
                .filter(|&i| {
                    let r = &p.rounds[i as usize];
                    !(r.locals.is_empty() && r.sends.is_empty() && r.recvs.is_empty())
                })
                .collect();
            assert_eq!(seen, busy, "{}", p.endpoint);
            let stats = c.stats().expect("complete");
            let sent: u64 = p.rounds.iter().flat_map(|r| &r.sends).map(|m| m.wire_bytes()).sum();
            let recv: u64 = p.rounds.iter().flat_map(|r| &r.recvs).map(|m| m.wire_bytes()).sum();
            assert_eq!((stats.sent_bytes, stats.recv_bytes), (sent, recv));
        }
    }

    #[test]
    fn a_round_expecting_one_peer_twice_is_refused_by_the_round_cursor() {
        let programs = programs();
        let mut p = programs.iter().find(|p| p.rounds.iter().any(|r| !r.recvs.is_empty())).expect("a receiving rank").clone();
        let r = p.rounds.iter_mut().find(|r| !r.recvs.is_empty()).unwrap();
        let twice = r.recvs[0].clone();
        r.recvs.push(twice);
        let mut c = RoundCursor::new(&p);
        let refused = loop {
            match c.next_round() {
                Err(e) => break e,
                Ok(Some(_)) => {}
                Ok(None) => panic!("the repeated peer was taken"),
            }
        };
        assert_eq!(refused.problem, "second message in one round");
    }

    #[test]
    fn unexpected_and_repeated_messages_are_refused() {
        let programs = programs();
        let p = programs.iter().find(|p| p.rounds.iter().any(|r| !r.recvs.is_empty())).expect("a receiving rank");
        let mut c = RankCursor::new(p);
        loop {
            match c.next_action() {
                Action::Recv { round } => {
                    let peer = p.rounds[round as usize].recvs[0].peer;
                    let stranger = Endpoint::dst(99);
                    assert_eq!(c.arrived(stranger).unwrap_err().problem, "no message expected from this peer");
                    assert!(c.arrived(peer).is_ok());
                    assert_eq!(c.arrived(peer).unwrap_err().problem, "second message in one round");
                    return;
                }
                Action::Done(_) => panic!("no receive"),
                _ => {}
            }
        }
    }
}
