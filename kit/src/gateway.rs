//! What the edge's and the worker's `[gateway]` sections share: how
//! `addr` is read (naming the field when it is wrong) and the certificate
//! name when none is given. Each crate keeps its own `GatewayConfig`
//! struct, with the same field names, defaults and `deny_unknown_fields`
//! as before: a struct flattened from one shared type would have changed
//! the errors users see (serde's `flatten` drops the list of expected
//! fields from an unknown-field error, and the TOML position moves from
//! the bad value to the table).

use serde::Deserialize;
use tidegate_protocol::GatewayAddr;

/// `gateway.server_name` when the config leaves it out: `localhost`, the
/// name in the development certificates (`tidegate-gateway dev-certs`).
pub fn default_server_name() -> String {
    "localhost".into()
}

/// Reads `gateway.addr` (`host:port` or `ip:port`), naming the field when
/// the address is wrong: `gateway.addr: gateway address "gw example:1"
/// contains whitespace`. For `#[serde(deserialize_with = ...)]`.
pub fn deserialize_addr<'de, D: serde::Deserializer<'de>>(d: D) -> Result<GatewayAddr, D::Error> {
    GatewayAddr::deserialize(d)
        .map_err(|e| serde::de::Error::custom(format_args!("gateway.addr: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Section {
        #[serde(deserialize_with = "deserialize_addr")]
        addr: GatewayAddr,
        #[serde(default = "default_server_name")]
        server_name: String,
    }

    fn section(text: &str) -> Result<Section, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    #[test]
    fn an_address_takes_a_name_or_an_ip_and_a_bad_one_names_the_field() {
        let s = section(r#"addr = "gw.example.com:4433""#).unwrap();
        assert_eq!(s.addr.name(), Some("gw.example.com"));
        assert_eq!(s.addr.port(), 4433);
        assert_eq!(s.server_name, "localhost");
        let s = section("addr = \"127.0.0.1:4433\"\nserver_name = \"gw\"").unwrap();
        assert_eq!(s.addr.ip(), Some("127.0.0.1:4433".parse().unwrap()));
        assert_eq!(s.server_name, "gw");
        for (addr, says) in [
            ("gw example:1", "contains whitespace"),
            ("gw.example.com", "has no port"),
        ] {
            let err = section(&format!("addr = \"{addr}\"")).unwrap_err();
            assert!(
                err.contains("gateway.addr: gateway address") && err.contains(says),
                "{addr}: {err}"
            );
        }
    }
}
