//! The faults a load run (`pdflow chaos --load`) gives single requests: every actor
//! kill the chaos matrix knows (each actor kind and role, at the beginning of every request step
//! at which it is alive and at the end of every step it owns — [`matrix::alive_steps`],
//! [`matrix::owned_steps`]) plus drop / corrupt / delay of the side-channel messages of steps 21
//! and 30. Node kills are left out: a whole-node kill stops every request on that node, it is not
//! a fault of one request (the matrix's `node.*` cells cover it, one request at a time).
//!
//! A seeded RNG ([`SplitMix64`]) picks which requests are hit and how; the picks become ONE
//! [`FaultPlan`] whose faults carry `request_id` = the picked request's client id (its
//! `X-Request-Id`, a substring of the flow's request id, so the filter matches on every node).
//!
//! Owns no seed step.

use pdflow_fault::{Fault, FaultAction, FaultPlan, When, MESSAGE_STEPS};
use serde::Serialize;

use crate::chaos::matrix::{alive_steps, owned_steps, targets};

/// How long a delayed side-channel message is held (the matrix's delay cells use the same).
pub const MESSAGE_DELAY_MS: u64 = 300;

/// One fault a request can be given; `fault.request_id` is unset until it is planned.
#[derive(Debug, Clone)]
pub struct RequestFault {
    /// `actor/step/fault`, as the matrix names its cells (`send_worker/29/kill@begin`).
    pub label: String,
    pub fault: Fault,
}

/// A fault given to one request of the run.
#[derive(Debug, Clone, Serialize)]
pub struct PlannedFault {
    /// Index of the request in the run.
    pub request: usize,
    /// Its client id (`X-Request-Id`), the plan's `request_id` filter.
    pub client_id: String,
    /// [`RequestFault::label`].
    pub fault: String,
}

/// The per-request faults, in a fixed order (so a seed always picks the same ones).
pub fn per_request_faults() -> Vec<RequestFault> {
    let mut out = Vec::new();
    let mut push = |label: String, step: u8, when: When, action: FaultAction| {
        out.push(RequestFault { label, fault: Fault::new(step, when, action) })
    };
    for (kind, role, label) in targets() {
        let action = FaultAction::Kill { actor: kind, role: Some(role) };
        for step in alive_steps(kind) {
            push(format!("{label}/{step:02}/kill@begin"), step, When::Begin, action.clone());
        }
        for step in owned_steps(kind, role).into_iter().filter(|s| alive_steps(kind).contains(s)) {
            push(format!("{label}/{step:02}/kill@end"), step, When::End, action.clone());
        }
    }
    for step in MESSAGE_STEPS {
        let sender = if step == MESSAGE_STEPS[0] { "pull_task" } else { "sender_listener" };
        push(format!("{sender}/{step:02}/drop"), step, When::Begin, FaultAction::Drop);
        push(format!("{sender}/{step:02}/corrupt"), step, When::Begin, FaultAction::Corrupt);
        push(
            format!("{sender}/{step:02}/delay_{MESSAGE_DELAY_MS}ms@begin"),
            step,
            When::Begin,
            FaultAction::Delay { ms: MESSAGE_DELAY_MS },
        );
    }
    out
}

/// A small seeded generator (SplitMix64): reproducible runs without another dependency.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0; 0 gives 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        (self.next_u64() % n as u64) as usize
    }
}

/// How many of `requests` a `rate` hits: ceil(requests × rate), at most all of them.
pub fn faults_for(requests: usize, rate: f64) -> usize {
    if rate.is_nan() || rate <= 0.0 || requests == 0 {
        return 0;
    }
    ((requests as f64 * rate).ceil() as usize).min(requests)
}

/// The menu without the faults whose label starts with one of `exclude` (`proxy/`, `receiver/19`).
pub fn menu_without(exclude: &[String]) -> Vec<RequestFault> {
    per_request_faults().into_iter().filter(|f| !exclude.iter().any(|x| f.label.starts_with(x.as_str()))).collect()
}

/// Picks ceil(requests × rate) distinct requests and a fault from `menu` for each; returns the
/// plan (each fault filtered to its request's client id) and what was picked, by request index.
pub fn plan(
    requests: usize,
    rate: f64,
    menu: &[RequestFault],
    rng: &mut SplitMix64,
    client_id: impl Fn(usize) -> String,
) -> (FaultPlan, Vec<PlannedFault>) {
    if menu.is_empty() {
        return (FaultPlan::default(), Vec::new());
    }
    let mut order: Vec<usize> = (0..requests).collect();
    let count = faults_for(requests, rate);
    // Partial Fisher-Yates: the first `count` entries are a uniform sample without repeats.
    for i in 0..count {
        let j = i + rng.below(requests - i);
        order.swap(i, j);
    }
    let mut picked: Vec<usize> = order[..count].to_vec();
    picked.sort_unstable();
    let mut faults = Vec::with_capacity(count);
    let mut planned = Vec::with_capacity(count);
    for request in picked {
        let choice = &menu[rng.below(menu.len())];
        let id = client_id(request);
        faults.push(Fault { request_id: Some(id.clone()), ..choice.fault.clone() });
        planned.push(PlannedFault { request, client_id: id, fault: choice.label.clone() });
    }
    (FaultPlan { faults }, planned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_menu_has_every_actor_kill_and_message_fault_and_no_node_kill() {
        let menu = per_request_faults();
        for (_, _, label) in targets() {
            assert!(menu.iter().any(|f| f.label.starts_with(&format!("{label}/"))), "{label} missing");
        }
        for kind in ["kill@begin", "kill@end", "drop", "corrupt", "delay_300ms@begin"] {
            assert!(menu.iter().any(|f| f.label.ends_with(kind)), "{kind} missing");
        }
        assert!(menu.iter().all(|f| !matches!(f.fault.action, FaultAction::KillNode { .. })), "no node kills");
        // A send worker lives from step 14 to 31 only: no kill of it outside that.
        assert!(menu.iter().filter(|f| f.label.starts_with("send_worker/")).all(|f| (14..=31).contains(&f.fault.step)));
        FaultPlan { faults: menu.iter().map(|f| f.fault.clone()).collect() }.validate().expect("every fault is valid");
        let mut labels: Vec<&str> = menu.iter().map(|f| f.label.as_str()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), menu.len(), "labels are unique");
    }

    #[test]
    fn a_seed_picks_ceil_n_rate_distinct_requests_each_filtered_to_its_client_id() {
        let id = |i: usize| format!("ld-{i:05}");
        let menu = per_request_faults();
        let (plan_a, picked_a) = plan(2000, 0.01, &menu, &mut SplitMix64::new(7), id);
        assert_eq!(plan_a.faults.len(), 20);
        let mut requests: Vec<usize> = picked_a.iter().map(|p| p.request).collect();
        requests.dedup();
        assert_eq!(requests.len(), 20, "distinct requests");
        for (f, p) in plan_a.faults.iter().zip(&picked_a) {
            assert_eq!(f.request_id.as_deref(), Some(id(p.request).as_str()));
            assert_eq!(f.times, 1);
        }
        let (plan_b, _) = plan(2000, 0.01, &menu, &mut SplitMix64::new(7), id);
        assert_eq!(plan_a, plan_b, "same seed, same plan");
        let (plan_c, _) = plan(2000, 0.01, &menu, &mut SplitMix64::new(8), id);
        let without = menu_without(&["proxy/".to_string()]);
        assert!(
            !without.is_empty() && without.len() < menu.len() && without.iter().all(|f| !f.label.starts_with("proxy/"))
        );
        assert_ne!(plan_a, plan_c, "another seed, another plan");
        assert_eq!(faults_for(240, 0.05), 12);
        assert_eq!(faults_for(10, 0.001), 1, "ceil: a small run still gets a fault");
        assert_eq!(faults_for(10, 0.0), 0);
        assert_eq!(faults_for(10, 5.0), 10);
    }
}
