//! The ids that name a request's parts across actors, processes and wires: an engine's request
//! id, the transfer id that ties P's request to D's, and an engine's id. Each is its own type, so
//! one is never passed where another is meant; on every wire (JSON, postcard) each is the plain
//! string it wraps.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;

use serde::{Deserialize, Serialize};

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn new(id: impl Into<String>) -> Self {
                Self(id.into())
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl From<String> for $name {
            fn from(id: String) -> Self {
                Self(id)
            }
        }

        impl From<&str> for $name {
            fn from(id: &str) -> Self {
                Self(id.to_owned())
            }
        }

        impl From<&String> for $name {
            fn from(id: &String) -> Self {
                Self(id.clone())
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                &self.0 == other
            }
        }
    };
}

string_id!(
    /// An engine's request id (P's and D's differ for one client request).
    RequestId
);
string_id!(
    /// The id that ties P's request to D's request: `xfer-<proxy request id>` (seed step 9).
    TransferId
);
string_id!(
    /// An engine's id, as registered with bootstrap.
    EngineId
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_its_string_on_every_wire() {
        let id = TransferId::new("xfer-42");
        assert_eq!(serde_json::to_string(&id).expect("json"), "\"xfer-42\"");
        let bytes = postcard::to_allocvec(&id).expect("postcard");
        assert_eq!(bytes, postcard::to_allocvec("xfer-42").expect("postcard"));
        assert_eq!(postcard::from_bytes::<TransferId>(&bytes).expect("decodes"), id);
        let map: std::collections::HashMap<RequestId, u32> = [(RequestId::from("r1"), 1)].into();
        assert_eq!(map.get("r1"), Some(&1), "looked up by &str");
        assert_eq!(id.to_string(), "xfer-42");
    }
}
