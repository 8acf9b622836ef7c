//! The fault plan a node process arms from `PDFLOW_FAULT_PLAN`, with the `fault-injection`
//! feature (the tests and the chaos suite build it). Without the feature this module reads no
//! environment variable and hands every node the empty seam.

#[cfg(not(feature = "fault-injection"))]
pub use disabled::*;
#[cfg(feature = "fault-injection")]
pub use enabled::*;

#[cfg(feature = "fault-injection")]
mod enabled {
    use std::sync::Arc;

    use pdflow_actors::fault_seam::{no_faults, Faults, Killable, NodeKind};
    pub use pdflow_fault::FaultLayer;
    use pdflow_fault::{FaultDomain, FaultPlan};
    use pdflow_transfer::tcp::TcpConfig;

    /// `PDFLOW_FAULT_PLAN` (JSON or `@path`), checked before anything binds: this process's fault
    /// domain with the plan armed (its cut writes use the node's data-channel settings `tcp`), or none.
    pub fn load_fault_plan(tcp: TcpConfig) -> anyhow::Result<Option<Arc<FaultDomain>>> {
        match FaultPlan::from_env() {
            Ok(None) => Ok(None),
            Ok(Some(plan)) => {
                eprintln!(
                    "pdflow: fault plan armed ({} faults from {})",
                    plan.faults.len(),
                    pdflow_fault::ENV_FAULT_PLAN
                );
                let domain = FaultDomain::new(tcp);
                domain.arm(plan);
                Ok(Some(domain))
            }
            Err(errors) => anyhow::bail!(
                "invalid fault plan:\n  {}",
                errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n  ")
            ),
        }
    }

    /// A node process's fault plan, if it was given one.
    pub struct NodeFaults(pub Option<Arc<FaultDomain>>);

    impl NodeFaults {
        /// The seam the node's actors are offered to.
        pub fn seam(&self) -> Faults {
            self.0.as_ref().map_or_else(no_faults, FaultDomain::seam)
        }

        /// Registers this process as the `kill_node` target `node`: the process exits at once (137,
        /// as after SIGKILL), without shutting anything down.
        pub fn register_process_kill(&self, node: NodeKind) {
            let Some(domain) = &self.0 else { return };
            domain.register_node(
                node,
                Killable {
                    alive: Box::new(|| true),
                    kill: Arc::new(move || {
                        eprintln!("pdflow: fault plan: killing this {} node", node.name());
                        std::process::exit(137);
                    }),
                },
            );
        }

        /// The tracing layer that fires the plan's faults at step edges.
        pub fn layer(&self) -> Option<FaultLayer> {
            self.0.as_ref().map(FaultDomain::layer)
        }
    }
}

#[cfg(not(feature = "fault-injection"))]
mod disabled {
    use pdflow_actors::fault_seam::{no_faults, Faults, NodeKind};
    use pdflow_transfer::tcp::TcpConfig;

    /// No layer: nothing fires at step edges.
    pub type FaultLayer = tracing_subscriber::layer::Identity;

    /// Built without fault injection: no plan is read.
    pub fn load_fault_plan(_tcp: TcpConfig) -> anyhow::Result<Option<NodeFaultsInner>> {
        Ok(None)
    }

    /// Never constructed: there is no fault domain.
    pub enum NodeFaultsInner {}

    /// A node process without a fault plan.
    pub struct NodeFaults(pub Option<NodeFaultsInner>);

    impl NodeFaults {
        /// The empty seam.
        pub fn seam(&self) -> Faults {
            no_faults()
        }

        /// Nothing to register.
        pub fn register_process_kill(&self, _node: NodeKind) {}

        /// No layer.
        pub fn layer(&self) -> Option<FaultLayer> {
            None
        }
    }
}
