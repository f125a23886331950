//! The pricing catalog: which instance types can be leased, what they are,
//! and what they cost per tier.
//!
//! The catalog is TOML (see `lease-core/catalog/default.toml`, which documents
//! where every number comes from). It is validated on load, so a typo in a
//! price or a billing unit is an error at startup naming the instance and
//! the field, not a wrong bill a week later. Prices are converted once to
//! integer [`Money`] (millionths of the currency unit per hour) so that cost
//! accrued block by block and cost recomputed from the ledger are equal to
//! the last unit.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::billing::Granularity;
use crate::cloud::{CloudConfig, CloudError, CloudSection};

/// An amount of money in millionths of the catalog's currency unit.
///
/// Integer so that sums are exact and order-independent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Money(pub i64);

impl Money {
    /// Zero.
    pub const ZERO: Money = Money(0);

    /// From a decimal amount, rounded to the nearest millionth.
    pub fn from_units(units: f64) -> Money {
        Money((units * 1_000_000.0).round() as i64)
    }

    /// As a decimal amount of the currency unit.
    pub fn units(self) -> f64 {
        self.0 as f64 / 1_000_000.0
    }
}

impl std::ops::Add for Money {
    type Output = Money;
    fn add(self, rhs: Money) -> Money {
        Money(self.0 + rhs.0)
    }
}

impl std::ops::AddAssign for Money {
    fn add_assign(&mut self, rhs: Money) {
        self.0 += rhs.0;
    }
}

impl std::ops::Sub for Money {
    type Output = Money;
    fn sub(self, rhs: Money) -> Money {
        Money(self.0 - rhs.0)
    }
}

impl std::iter::Sum for Money {
    fn sum<I: Iterator<Item = Money>>(iter: I) -> Money {
        Money(iter.map(|m| m.0).sum())
    }
}

impl fmt::Display for Money {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.2}", self.units())
    }
}

impl Serialize for Money {
    /// Serialised as a decimal number of currency units (JSON-friendly).
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.units())
    }
}

impl<'de> Deserialize<'de> for Money {
    /// Read as a decimal number of currency units.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Money, D::Error> {
        let v = f64::deserialize(d)?;
        if !v.is_finite() {
            return Err(serde::de::Error::custom("amount must be a finite number"));
        }
        Ok(Money::from_units(v))
    }
}

/// Highest price per hour the catalog accepts, in currency units: far
/// above any GPU instance, and low enough that sums of prices and of
/// charged blocks stay exact in [`Money`] (an `i64` of millionths) over
/// years of thousands of leases.
pub const MAX_PRICE_PER_HOUR: f64 = 100_000.0;

/// How a lease is bought.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Pay as you go; never reclaimed.
    OnDemand,
    /// Discounted spare capacity; can be preempted after a notice.
    Spot,
    /// Committed capacity at a discount.
    Reserved,
}

impl Tier {
    /// Every tier, in a stable order.
    pub const ALL: [Tier; 3] = [Tier::OnDemand, Tier::Spot, Tier::Reserved];

    /// The name used in TOML, SQL and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::OnDemand => "on_demand",
            Tier::Spot => "spot",
            Tier::Reserved => "reserved",
        }
    }

    /// Parses [`Tier::as_str`]'s output.
    pub fn parse(s: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Price per hour in each tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TierPrices {
    /// On-demand price per hour.
    pub on_demand: Money,
    /// Spot price per hour.
    pub spot: Money,
    /// Reserved price per hour (effective, amortised).
    pub reserved: Money,
}

impl TierPrices {
    /// The hourly price of `tier`.
    pub fn get(&self, tier: Tier) -> Money {
        match tier {
            Tier::OnDemand => self.on_demand,
            Tier::Spot => self.spot,
            Tier::Reserved => self.reserved,
        }
    }
}

/// One leasable instance type.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InstanceType {
    /// Catalog name (`a100`).
    pub name: String,
    /// The GPU model, for people (`NVIDIA A100 SXM4 80GB`).
    pub gpu_model: String,
    /// GPUs per instance (0 for a CPU type).
    pub gpus: u32,
    /// Memory per GPU, GiB.
    pub gpu_memory_gib: f64,
    /// Dense FP16 tensor TFLOPS per instance.
    pub fp16_tflops: f64,
    /// Memory bandwidth, GB/s.
    pub memory_bandwidth_gbs: f64,
    /// Hourly prices.
    pub price_per_hour: TierPrices,
    /// How time is billed.
    pub granularity: Granularity,
    /// Expected spot preemptions per hour of a spot lease.
    pub spot_interruptions_per_hour: f64,
    /// Seconds from acquire until the worker is warm: the median (the
    /// autoscaler plans with it).
    pub startup_secs: u32,
    /// The 95th percentile of the start-up, seconds (at least the median;
    /// equal to it for a constant start-up, the default).
    pub startup_p95_secs: u32,
    /// How many leases of this type the cloud has (the simulator refuses an
    /// acquire beyond it).
    pub capacity: Capacity,
}

/// How many leases of one type the cloud has, per tier (None: unlimited).
/// The reserved tier's capacity is the reserved commitment, not set here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capacity {
    /// On-demand leases at most.
    #[serde(default)]
    pub on_demand: Option<u32>,
    /// Spot leases at most.
    #[serde(default)]
    pub spot: Option<u32>,
}

/// The whole catalog.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Catalog {
    /// ISO currency code of every price (`CNY`).
    pub currency: String,
    /// Instance types, in file order.
    pub instances: Vec<InstanceType>,
    /// How the simulated cloud behaves (`[cloud]`; default: the `default`
    /// preset).
    pub cloud: CloudConfig,
}

/// Why a catalog could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CatalogError {
    /// The file could not be read.
    #[error("cannot read catalog {path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The TOML did not parse or had unknown/missing fields.
    #[error("catalog is not valid TOML for the expected schema: {0}")]
    Parse(#[from] toml::de::Error),
    /// No instance types.
    #[error("catalog lists no [[instance]]; add at least one")]
    Empty,
    /// Currency is not a three-letter code.
    #[error("currency {0:?} is not a three-letter ISO code such as \"CNY\"")]
    Currency(String),
    /// Two types share a name.
    #[error("instance {0:?} is listed twice; names must be unique")]
    Duplicate(String),
    /// A price below zero (or not finite).
    #[error("instance {instance:?}: {tier} price {price} per hour is negative or not a number")]
    NegativePrice {
        /// Instance name.
        instance: String,
        /// Tier.
        tier: Tier,
        /// The price given.
        price: f64,
    },
    /// A price above [`MAX_PRICE_PER_HOUR`].
    #[error(
        "instance {instance:?}: {tier} price {price} per hour is above {max}; is it in the currency's units per hour?"
    )]
    PriceTooHigh {
        /// Instance name.
        instance: String,
        /// Tier.
        tier: Tier,
        /// The price given.
        price: f64,
        /// The highest accepted.
        max: f64,
    },
    /// An unknown billing unit.
    #[error(
        "instance {instance:?}: unknown billing granularity {value:?}; use \"hour\" or \"second\""
    )]
    UnknownGranularity {
        /// Instance name.
        instance: String,
        /// What was given.
        value: String,
    },
    /// Spot must be strictly cheaper than on-demand.
    #[error("instance {instance:?}: spot price {spot} is not below on-demand {on_demand}")]
    SpotNotCheaper {
        /// Instance name.
        instance: String,
        /// Spot price.
        spot: f64,
        /// On-demand price.
        on_demand: f64,
    },
    /// Reserved must not cost more than on-demand.
    #[error("instance {instance:?}: reserved price {reserved} is above on-demand {on_demand}")]
    ReservedAboveOnDemand {
        /// Instance name.
        instance: String,
        /// Reserved price.
        reserved: f64,
        /// On-demand price.
        on_demand: f64,
    },
    /// The `[cloud]` section is invalid.
    #[error("[cloud]: {0}")]
    Cloud(#[from] CloudError),
    /// Any other out-of-range field.
    #[error("instance {instance:?}: field {field} {reason}")]
    Field {
        /// Instance name.
        instance: String,
        /// Field name.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCatalog {
    currency: String,
    #[serde(default)]
    instance: Vec<RawInstance>,
    #[serde(default)]
    cloud: Option<CloudSection>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInstance {
    name: String,
    gpu_model: String,
    gpus: u32,
    gpu_memory_gib: f64,
    fp16_tflops: f64,
    memory_bandwidth_gbs: f64,
    billing: String,
    billing_minimum_secs: Option<u32>,
    spot_interruptions_per_hour: f64,
    startup_secs: u32,
    startup_p95_secs: Option<u32>,
    #[serde(default)]
    capacity: Capacity,
    price_per_hour: RawPrices,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPrices {
    on_demand: f64,
    spot: f64,
    reserved: f64,
}

/// The default catalog shipped in `lease-core/catalog/default.toml`.
pub const DEFAULT_CATALOG_TOML: &str = include_str!("../catalog/default.toml");

impl Catalog {
    /// The shipped default catalog (V100, A100, H100, H200, CPU).
    pub fn default_catalog() -> Catalog {
        // The shipped file is checked by a unit test; failing here is a
        // build defect, not a runtime condition.
        Catalog::from_toml(DEFAULT_CATALOG_TOML).expect("shipped default catalog is valid")
    }

    /// Reads and validates a catalog file.
    pub fn load(path: &Path) -> Result<Catalog, CatalogError> {
        let text = std::fs::read_to_string(path).map_err(|source| CatalogError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Catalog::from_toml(&text)
    }

    /// Parses and validates catalog TOML.
    pub fn from_toml(text: &str) -> Result<Catalog, CatalogError> {
        let raw: RawCatalog = toml::from_str(text)?;
        let currency = raw.currency.trim().to_string();
        if currency.len() != 3 || !currency.chars().all(|c| c.is_ascii_uppercase()) {
            return Err(CatalogError::Currency(raw.currency));
        }
        if raw.instance.is_empty() {
            return Err(CatalogError::Empty);
        }
        let mut instances: Vec<InstanceType> = Vec::with_capacity(raw.instance.len());
        for r in raw.instance {
            if instances.iter().any(|i| i.name == r.name) {
                return Err(CatalogError::Duplicate(r.name));
            }
            instances.push(validate_instance(r)?);
        }
        Ok(Catalog {
            currency,
            instances,
            cloud: raw.cloud.unwrap_or_default().resolve()?,
        })
    }

    /// The instance type called `name`.
    pub fn get(&self, name: &str) -> Option<&InstanceType> {
        self.instances.iter().find(|i| i.name == name)
    }
}

fn field(instance: &str, field: &'static str, reason: impl Into<String>) -> CatalogError {
    CatalogError::Field {
        instance: instance.to_string(),
        field,
        reason: reason.into(),
    }
}

/// One instance type of the file, checked field by field; the error
/// names the type and the field.
fn validate_instance(r: RawInstance) -> Result<InstanceType, CatalogError> {
    let name = r.name.clone();
    check_name(&name)?;
    check_hardware(&r)?;
    let startup_p95_secs = check_spot_and_startup(&r)?;
    let granularity = billing_granularity(&r)?;
    check_prices(&name, &r.price_per_hour)?;
    let p = &r.price_per_hour;
    Ok(InstanceType {
        name: r.name,
        gpu_model: r.gpu_model,
        gpus: r.gpus,
        gpu_memory_gib: r.gpu_memory_gib,
        fp16_tflops: r.fp16_tflops,
        memory_bandwidth_gbs: r.memory_bandwidth_gbs,
        price_per_hour: TierPrices {
            on_demand: Money::from_units(p.on_demand),
            spot: Money::from_units(p.spot),
            reserved: Money::from_units(p.reserved),
        },
        granularity,
        spot_interruptions_per_hour: r.spot_interruptions_per_hour,
        startup_secs: r.startup_secs,
        startup_p95_secs,
        capacity: r.capacity,
    })
}

/// An instance type's name: ASCII letters, digits, '-', '_' or '.'.
fn check_name(name: &str) -> Result<(), CatalogError> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
    {
        return Err(field(
            name,
            "name",
            "must be non-empty ASCII letters, digits, '-', '_' or '.'",
        ));
    }
    Ok(())
}

/// Its GPU figures: numbers, none negative, and FP16 throughput above
/// zero (the simulator divides by it).
fn check_hardware(r: &RawInstance) -> Result<(), CatalogError> {
    let name = &r.name;
    for (f, v) in [
        ("gpu_memory_gib", r.gpu_memory_gib),
        ("fp16_tflops", r.fp16_tflops),
        ("memory_bandwidth_gbs", r.memory_bandwidth_gbs),
    ] {
        if !v.is_finite() || v < 0.0 {
            return Err(field(name, f, format!("is {v}; must be a number >= 0")));
        }
    }
    if r.fp16_tflops <= 0.0 {
        return Err(field(
            name,
            "fp16_tflops",
            "must be > 0 (the simulator divides by it)",
        ));
    }
    Ok(())
}

/// Its spot interruption rate (within 0..=1 per hour) and start-up times
/// (at most an hour, the p95 no less than the median); returns the p95,
/// which defaults to the median.
fn check_spot_and_startup(r: &RawInstance) -> Result<u32, CatalogError> {
    let name = &r.name;
    if !r.spot_interruptions_per_hour.is_finite()
        || !(0.0..=1.0).contains(&r.spot_interruptions_per_hour)
    {
        return Err(field(
            name,
            "spot_interruptions_per_hour",
            format!("is {}; must be within 0..=1", r.spot_interruptions_per_hour),
        ));
    }
    if r.startup_secs > 3600 {
        return Err(field(
            name,
            "startup_secs",
            "is over an hour; is it in seconds?",
        ));
    }
    let startup_p95_secs = r.startup_p95_secs.unwrap_or(r.startup_secs);
    if !(r.startup_secs..=3600).contains(&startup_p95_secs) {
        return Err(field(
            name,
            "startup_p95_secs",
            format!(
                "is {startup_p95_secs}; must be within startup_secs ({})..=3600 (the p95 of the start-up, at least its median)",
                r.startup_secs
            ),
        ));
    }
    Ok(startup_p95_secs)
}

/// How it is billed: by the hour, or by the second with a minimum
/// (60 s unless given, at most an hour).
fn billing_granularity(r: &RawInstance) -> Result<Granularity, CatalogError> {
    let name = &r.name;
    match r.billing.as_str() {
        "hour" => {
            if r.billing_minimum_secs.is_some() {
                return Err(field(
                    name,
                    "billing_minimum_secs",
                    "only applies to billing = \"second\"",
                ));
            }
            Ok(Granularity::Hour)
        }
        "second" => {
            let minimum_secs = r.billing_minimum_secs.unwrap_or(60);
            if minimum_secs == 0 || minimum_secs > 3600 {
                return Err(field(
                    name,
                    "billing_minimum_secs",
                    format!("is {minimum_secs}; must be within 1..=3600"),
                ));
            }
            Ok(Granularity::Second { minimum_secs })
        }
        other => Err(CatalogError::UnknownGranularity {
            instance: name.clone(),
            value: other.to_string(),
        }),
    }
}

/// Its prices: each a number within 0..=[`MAX_PRICE_PER_HOUR`], spot
/// below on-demand, reserved not above it.
fn check_prices(name: &str, p: &RawPrices) -> Result<(), CatalogError> {
    for (tier, price) in [
        (Tier::OnDemand, p.on_demand),
        (Tier::Spot, p.spot),
        (Tier::Reserved, p.reserved),
    ] {
        if !price.is_finite() || price < 0.0 {
            return Err(CatalogError::NegativePrice {
                instance: name.to_string(),
                tier,
                price,
            });
        }
        if price > MAX_PRICE_PER_HOUR {
            return Err(CatalogError::PriceTooHigh {
                instance: name.to_string(),
                tier,
                price,
                max: MAX_PRICE_PER_HOUR,
            });
        }
    }
    if p.spot >= p.on_demand {
        return Err(CatalogError::SpotNotCheaper {
            instance: name.to_string(),
            spot: p.spot,
            on_demand: p.on_demand,
        });
    }
    if p.reserved > p.on_demand {
        return Err(CatalogError::ReservedAboveOnDemand {
            instance: name.to_string(),
            reserved: p.reserved,
            on_demand: p.on_demand,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_catalog_loads_with_all_five_types() {
        let c = Catalog::default_catalog();
        assert_eq!(c.currency, "CNY");
        for n in ["v100", "a100", "h100", "h200", "cpu-32"] {
            assert!(c.get(n).is_some(), "{n} missing");
        }
    }

    #[test]
    fn default_prices_follow_the_documented_rule() {
        let c = Catalog::default_catalog();
        let a100 = c.get("a100").unwrap();
        let od = a100.price_per_hour.on_demand.units();
        assert!(
            (15.0..=30.0).contains(&od),
            "A100 on-demand {od} outside 15-30"
        );
        for i in &c.instances {
            let p = i.price_per_hour;
            let od = p.on_demand.units();
            // spot 65% below, reserved 35% below, to the cent
            assert!((p.spot.units() - od * 0.35).abs() <= 0.006, "{}", i.name);
            assert!(
                (p.reserved.units() - od * 0.65).abs() <= 0.006,
                "{}",
                i.name
            );
            if i.gpus > 0 {
                let cap = ((i.fp16_tflops / a100.fp16_tflops)
                    * (i.memory_bandwidth_gbs / a100.memory_bandwidth_gbs))
                    .sqrt();
                let expect = 22.0 * cap.powf(0.8);
                assert!((od - expect).abs() <= 0.006, "{}: {od} vs {expect}", i.name);
            }
        }
    }

    fn one(prices: &str, billing: &str) -> String {
        format!(
            "currency = \"CNY\"\n[[instance]]\nname = \"x\"\ngpu_model = \"X\"\ngpus = 1\n\
             gpu_memory_gib = 1.0\nfp16_tflops = 1.0\nmemory_bandwidth_gbs = 1.0\n\
             {billing}\nspot_interruptions_per_hour = 0.1\nstartup_secs = 10\n\
             price_per_hour = {{ {prices} }}\n"
        )
    }

    #[test]
    fn negative_price_is_rejected_naming_instance_and_tier() {
        let e = Catalog::from_toml(&one(
            "on_demand = 10.0, spot = -1.0, reserved = 5.0",
            "billing = \"hour\"",
        ))
        .unwrap_err();
        assert!(
            matches!(
                e,
                CatalogError::NegativePrice {
                    tier: Tier::Spot,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("\"x\""));
    }

    #[test]
    fn an_absurd_price_is_rejected_before_it_can_overflow_money() {
        for on_demand in ["1e20", "100000.5"] {
            let e = Catalog::from_toml(&one(
                &format!("on_demand = {on_demand}, spot = 1.0, reserved = 5.0"),
                "billing = \"hour\"",
            ))
            .unwrap_err();
            assert!(
                matches!(
                    e,
                    CatalogError::PriceTooHigh {
                        tier: Tier::OnDemand,
                        ..
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().contains("\"x\""), "{e}");
        }
        // the highest accepted price is exact in Money, and so are a
        // thousand leases' worth of a year's hourly blocks
        let c = Catalog::from_toml(&one(
            "on_demand = 100000.0, spot = 1.0, reserved = 5.0",
            "billing = \"hour\"",
        ))
        .unwrap();
        let p = c.instances[0].price_per_hour.on_demand;
        assert_eq!(p, Money::from_units(MAX_PRICE_PER_HOUR));
        assert!(p.0.checked_mul(1000 * 24 * 366).is_some());
    }

    #[test]
    fn unknown_granularity_is_rejected() {
        let e = Catalog::from_toml(&one(
            "on_demand = 10.0, spot = 1.0, reserved = 5.0",
            "billing = \"minute\"",
        ))
        .unwrap_err();
        assert!(matches!(e, CatalogError::UnknownGranularity { .. }), "{e}");
        assert!(e.to_string().contains("\"hour\" or \"second\""));
    }

    #[test]
    fn spot_at_or_above_on_demand_is_rejected() {
        let e = Catalog::from_toml(&one(
            "on_demand = 10.0, spot = 10.0, reserved = 5.0",
            "billing = \"hour\"",
        ))
        .unwrap_err();
        assert!(matches!(e, CatalogError::SpotNotCheaper { .. }), "{e}");
    }

    #[test]
    fn reserved_above_on_demand_is_rejected() {
        let e = Catalog::from_toml(&one(
            "on_demand = 10.0, spot = 1.0, reserved = 11.0",
            "billing = \"hour\"",
        ))
        .unwrap_err();
        assert!(
            matches!(e, CatalogError::ReservedAboveOnDemand { .. }),
            "{e}"
        );
    }

    #[test]
    fn second_billing_takes_a_minimum_and_hour_rejects_one() {
        let c = Catalog::from_toml(&one(
            "on_demand = 10.0, spot = 1.0, reserved = 5.0",
            "billing = \"second\"\nbilling_minimum_secs = 120",
        ))
        .unwrap();
        assert_eq!(
            c.instances[0].granularity,
            Granularity::Second { minimum_secs: 120 }
        );
        let e = Catalog::from_toml(&one(
            "on_demand = 10.0, spot = 1.0, reserved = 5.0",
            "billing = \"hour\"\nbilling_minimum_secs = 120",
        ))
        .unwrap_err();
        assert!(matches!(
            e,
            CatalogError::Field {
                field: "billing_minimum_secs",
                ..
            }
        ));
    }

    #[test]
    fn unknown_field_and_duplicate_are_rejected() {
        let text = one(
            "on_demand = 10.0, spot = 1.0, reserved = 5.0",
            "billing = \"hour\"",
        );
        let e = Catalog::from_toml(&format!("{text}colour = 1\n")).unwrap_err();
        assert!(matches!(e, CatalogError::Parse(_)), "{e}");
        let body = text.split_once('\n').unwrap().1;
        let e = Catalog::from_toml(&format!("{text}{body}")).unwrap_err();
        assert!(matches!(e, CatalogError::Duplicate(_)), "{e}");
    }
}
