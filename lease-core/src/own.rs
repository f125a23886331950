//! Renting against owning: what a fleet of GPUs would cost if bought,
//! set next to what renting it cost in the simulator.
//!
//! Owning a GPU costs, per hour of its life, a fixed part (the purchase
//! written off in a straight line over `depreciation_years`, plus hosting
//! and operations) whether it is busy or not, and power for the hours it
//! is busy. Renting costs what the simulator's report says. Over a trace of
//! `hours`, an owned fleet of `fleet_gpus` (sized for the peak, as
//! static-peak is) costs
//!
//! ```text
//! owned = fleet_gpus × hours × (purchase / (years × 8760) + ops_per_year / 8760)
//!       + busy_gpu_hours × kw_per_gpu × price_per_kwh
//! ```
//!
//! that is, the period's share of the depreciation and operations, not the
//! purchase: the rest of the fleet's life is assumed to be used (or paid
//! for) elsewhere. Whether that holds is the question the break-even
//! utilisation answers: with a fixed cost `F` per owned GPU-hour and power
//! `P` per busy GPU-hour, owning costs `F / u + P` per busy GPU-hour at a
//! utilisation `u` over the fleet's life, and renting `R` (a rental's cost
//! over the busy GPU-hours it served); owning is cheaper when
//! `u > F / (R − P)`.
//!
//! Amounts are plain numbers in the catalog's currency. Pure: no IO.

use serde::{Deserialize, Serialize};

/// Hours in a (365-day) year.
pub const HOURS_PER_YEAR: f64 = 8760.0;

/// What owning a GPU costs. Every amount in the catalog's currency.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ownership {
    /// Purchase price of one GPU with its share of the server.
    pub purchase_per_gpu: f64,
    /// Years over which the purchase is written off (straight line, no
    /// resale value).
    pub depreciation_years: f64,
    /// Power of one busy GPU with its share of the server and cooling
    /// (kW; multiply the IT power by the site's PUE).
    pub kw_per_gpu: f64,
    /// Price of a kWh.
    pub price_per_kwh: f64,
    /// Hosting and operations per GPU per year (rack space, network,
    /// support contracts, a share of the staff).
    pub ops_per_gpu_year: f64,
}

/// Why an ownership could not be priced.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum OwnError {
    /// A number out of its range.
    #[error("{field} = {value} {must}")]
    Invalid {
        /// The input.
        field: &'static str,
        /// Its value.
        value: f64,
        /// What it must be.
        must: &'static str,
    },
}

fn check(field: &'static str, value: f64, positive: bool) -> Result<(), OwnError> {
    let ok = value.is_finite() && if positive { value > 0.0 } else { value >= 0.0 };
    if ok {
        Ok(())
    } else {
        Err(OwnError::Invalid {
            field,
            value,
            must: if positive {
                "must be a number above 0"
            } else {
                "must be a number ≥ 0"
            },
        })
    }
}

impl Ownership {
    /// From a server's price and its GPUs: each GPU carries an equal share.
    pub fn per_server(
        server_price: f64,
        gpus_per_server: u32,
        depreciation_years: f64,
        kw_per_gpu: f64,
        price_per_kwh: f64,
        ops_per_gpu_year: f64,
    ) -> Result<Ownership, OwnError> {
        check("gpus_per_server", f64::from(gpus_per_server), true)?;
        let own = Ownership {
            purchase_per_gpu: server_price / f64::from(gpus_per_server),
            depreciation_years,
            kw_per_gpu,
            price_per_kwh,
            ops_per_gpu_year,
        };
        own.validate()?;
        Ok(own)
    }

    /// Checks every input: a purchase and a depreciation period above 0,
    /// the rest ≥ 0, all finite.
    pub fn validate(&self) -> Result<(), OwnError> {
        check("purchase_per_gpu", self.purchase_per_gpu, true)?;
        check("depreciation_years", self.depreciation_years, true)?;
        check("kw_per_gpu", self.kw_per_gpu, false)?;
        check("price_per_kwh", self.price_per_kwh, false)?;
        check("ops_per_gpu_year", self.ops_per_gpu_year, false)
    }

    /// Depreciation and operations per owned GPU-hour, busy or not.
    pub fn fixed_per_gpu_hour(&self) -> f64 {
        (self.purchase_per_gpu / self.depreciation_years + self.ops_per_gpu_year) / HOURS_PER_YEAR
    }

    /// Power per busy GPU-hour.
    pub fn power_per_busy_gpu_hour(&self) -> f64 {
        self.kw_per_gpu * self.price_per_kwh
    }

    /// Cost per owned GPU-hour when the fleet is busy `utilisation` of
    /// the time.
    pub fn cost_per_gpu_hour(&self, utilisation: f64) -> f64 {
        self.fixed_per_gpu_hour() + utilisation * self.power_per_busy_gpu_hour()
    }

    /// Cost per busy GPU-hour at `utilisation` (None at 0: nothing is
    /// served).
    pub fn cost_per_busy_gpu_hour(&self, utilisation: f64) -> Option<f64> {
        (utilisation > 0.0)
            .then(|| self.fixed_per_gpu_hour() / utilisation + self.power_per_busy_gpu_hour())
    }

    /// The utilisation (over the fleet's life) above which owning costs
    /// less per busy GPU-hour than renting at `rent_per_busy_gpu_hour`.
    /// None when renting costs no more than the power alone: owning never
    /// pays. A value above 1 means it pays at no reachable utilisation.
    pub fn break_even_utilisation(&self, rent_per_busy_gpu_hour: f64) -> Option<f64> {
        let margin = rent_per_busy_gpu_hour - self.power_per_busy_gpu_hour();
        (margin > 0.0).then(|| self.fixed_per_gpu_hour() / margin)
    }

    /// What `fleet_gpus` owned GPUs cost over `hours` in which they were
    /// busy `busy_gpu_hours` in all.
    pub fn owned_cost(&self, fleet_gpus: u32, hours: f64, busy_gpu_hours: f64) -> OwnedCost {
        let gpu_hours = f64::from(fleet_gpus) * hours;
        let depreciation =
            gpu_hours * self.purchase_per_gpu / self.depreciation_years / HOURS_PER_YEAR;
        let ops = gpu_hours * self.ops_per_gpu_year / HOURS_PER_YEAR;
        let power = busy_gpu_hours * self.power_per_busy_gpu_hour();
        OwnedCost {
            fleet_gpus,
            hours,
            busy_gpu_hours,
            purchase: f64::from(fleet_gpus) * self.purchase_per_gpu,
            depreciation,
            ops,
            power,
            total: depreciation + ops + power,
        }
    }
}

/// The cost of an owned fleet over a period.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OwnedCost {
    /// GPUs owned.
    pub fleet_gpus: u32,
    /// Length of the period (h).
    pub hours: f64,
    /// GPU-hours busy in it.
    pub busy_gpu_hours: f64,
    /// What buying the fleet costs up front (not part of `total`).
    pub purchase: f64,
    /// The period's share of the depreciation.
    pub depreciation: f64,
    /// The period's share of hosting and operations.
    pub ops: f64,
    /// Power for the busy hours.
    pub power: f64,
    /// depreciation + ops + power.
    pub total: f64,
}

/// One way of renting, as simulated.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rental {
    /// What it is (a policy's name).
    pub label: String,
    /// What renting cost over the period.
    pub cost: f64,
    /// GPU-hours busy (serving frames) in it.
    pub busy_gpu_hours: f64,
    /// cost / busy GPU-hours (None when nothing was served).
    pub cost_per_busy_gpu_hour: Option<f64>,
    /// Fleet utilisation over its life above which owning is cheaper (see
    /// [`Ownership::break_even_utilisation`]).
    pub break_even_utilisation: Option<f64>,
    /// Renting cost / the owned fleet's cost over the period.
    pub vs_owned: Option<f64>,
}

/// Renting and owning side by side.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RentVsOwn {
    /// The inputs.
    pub ownership: Ownership,
    /// Owning over the period.
    pub owned: OwnedCost,
    /// The owned fleet's utilisation over the period.
    pub owned_utilisation: f64,
    /// Cost per owned GPU-hour at that utilisation.
    pub owned_cost_per_gpu_hour: f64,
    /// Each rental.
    pub rentals: Vec<Rental>,
}

/// Puts `rentals` (label, cost, busy GPU-hours) next to owning
/// `fleet_gpus` for `hours` while `busy_gpu_hours` of work is served.
pub fn compare(
    own: &Ownership,
    fleet_gpus: u32,
    hours: f64,
    busy_gpu_hours: f64,
    rentals: &[(String, f64, f64)],
) -> Result<RentVsOwn, OwnError> {
    own.validate()?;
    check("fleet_gpus", f64::from(fleet_gpus), true)?;
    check("hours", hours, true)?;
    check("busy_gpu_hours", busy_gpu_hours, false)?;
    let owned = own.owned_cost(fleet_gpus, hours, busy_gpu_hours);
    let owned_utilisation = busy_gpu_hours / (f64::from(fleet_gpus) * hours);
    let rentals = rentals
        .iter()
        .map(|(label, cost, busy)| {
            let per_busy = (*busy > 0.0).then(|| cost / busy);
            Rental {
                label: label.clone(),
                cost: *cost,
                busy_gpu_hours: *busy,
                cost_per_busy_gpu_hour: per_busy,
                break_even_utilisation: per_busy.and_then(|r| own.break_even_utilisation(r)),
                vs_owned: (owned.total > 0.0).then(|| cost / owned.total),
            }
        })
        .collect();
    Ok(RentVsOwn {
        ownership: own.clone(),
        owned_cost_per_gpu_hour: own.cost_per_gpu_hour(owned_utilisation),
        owned,
        owned_utilisation,
        rentals,
    })
}

impl RentVsOwn {
    /// A Markdown table: owning (the purchase, and the period's share),
    /// then each rental with its break-even utilisation.
    pub fn to_markdown(&self) -> String {
        let o = &self.owned;
        let mut s = format!(
            "| what | cost | per busy GPU-h | break-even utilisation |\n|---|---:|---:|---:|\n\
             | buy {} GPUs (up front) | {:.0} | | |\n\
             | own them for {:.0} h (depreciation {:.0} + ops {:.0} + power {:.0}) | {:.0} | {} | |\n",
            o.fleet_gpus,
            o.purchase,
            o.hours,
            o.depreciation,
            o.ops,
            o.power,
            o.total,
            fmt_opt(
                self.ownership
                    .cost_per_busy_gpu_hour(self.owned_utilisation),
                2
            ),
        );
        for r in &self.rentals {
            s += &format!(
                "| rent: {} | {:.0} | {} | {} |\n",
                r.label,
                r.cost,
                fmt_opt(r.cost_per_busy_gpu_hour, 2),
                r.break_even_utilisation
                    .map_or("never".to_string(), |u| format!("{:.1}%", u * 100.0)),
            );
        }
        s
    }
}

fn fmt_opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or("–".to_string(), |v| format!("{v:.decimals$}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 26,280 per GPU over 3 years = 1.00 an hour; ops 876 a year = 0.10
    /// an hour; 0.5 kW at 0.8 = 0.40 per busy hour.
    fn own() -> Ownership {
        Ownership {
            purchase_per_gpu: 26_280.0,
            depreciation_years: 3.0,
            kw_per_gpu: 0.5,
            price_per_kwh: 0.8,
            ops_per_gpu_year: 876.0,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn cost_per_gpu_hour_is_depreciation_and_ops_plus_power_when_busy() {
        let o = own();
        assert!(close(o.fixed_per_gpu_hour(), 1.10));
        assert!(close(o.power_per_busy_gpu_hour(), 0.40));
        // half busy: 1.10 + 0.5 × 0.40
        assert!(close(o.cost_per_gpu_hour(0.5), 1.30));
        // per busy hour: 1.10 / 0.5 + 0.40
        assert!(close(o.cost_per_busy_gpu_hour(0.5).unwrap(), 2.60));
        assert_eq!(o.cost_per_busy_gpu_hour(0.0), None);
    }

    #[test]
    fn a_server_price_is_shared_by_its_gpus() {
        let o = Ownership::per_server(8.0 * 26_280.0, 8, 3.0, 0.5, 0.8, 876.0).unwrap();
        assert_eq!(o, own());
        let e = Ownership::per_server(100.0, 0, 3.0, 0.5, 0.8, 0.0).unwrap_err();
        assert!(e.to_string().contains("gpus_per_server"), "{e}");
    }

    #[test]
    fn break_even_is_the_fixed_cost_over_rent_less_power() {
        let o = own();
        // renting at 11.40 per busy hour: 1.10 / (11.40 − 0.40) = 10%
        assert!(close(o.break_even_utilisation(11.40).unwrap(), 0.10));
        // at that utilisation owning costs exactly the rent
        assert!(close(o.cost_per_busy_gpu_hour(0.10).unwrap(), 11.40));
        // renting at 1.50: 1.10 / 1.10 = 100%, the whole life busy
        assert!(close(o.break_even_utilisation(1.50).unwrap(), 1.0));
        // renting no dearer than the power: owning never pays
        assert_eq!(o.break_even_utilisation(0.40), None);
    }

    #[test]
    fn a_period_of_an_owned_fleet_costs_its_share_of_depreciation_and_ops_and_its_power() {
        // 10 GPUs for 72 h, busy 360 GPU-hours
        let c = own().owned_cost(10, 72.0, 360.0);
        assert!(close(c.depreciation, 720.0)); // 720 GPU-h × 1.00
        assert!(close(c.ops, 72.0)); // 720 GPU-h × 0.10
        assert!(close(c.power, 144.0)); // 360 × 0.40
        assert!(close(c.total, 936.0));
        assert!(close(c.purchase, 262_800.0));
    }

    #[test]
    fn compare_prices_each_rental_against_the_owned_fleet() {
        let rentals = vec![
            ("static".to_string(), 4_104.0, 360.0),
            ("idle".to_string(), 0.0, 0.0),
        ];
        let r = compare(&own(), 10, 72.0, 360.0, &rentals).unwrap();
        assert!(close(r.owned_utilisation, 0.5));
        assert!(close(r.owned_cost_per_gpu_hour, 1.30));
        // 4104 / 360 = 11.40 per busy hour → 10%
        let s = &r.rentals[0];
        assert!(close(s.cost_per_busy_gpu_hour.unwrap(), 11.40));
        assert!(close(s.break_even_utilisation.unwrap(), 0.10));
        assert!(close(s.vs_owned.unwrap(), 4_104.0 / 936.0));
        assert_eq!(r.rentals[1].cost_per_busy_gpu_hour, None);
        assert_eq!(r.rentals[1].break_even_utilisation, None);
        let md = r.to_markdown();
        assert!(
            md.contains("| rent: static | 4104 | 11.40 | 10.0% |"),
            "{md}"
        );
        assert!(md.contains("| rent: idle | 0 | – | never |"), "{md}");
    }

    #[test]
    fn bad_inputs_are_named() {
        let mut o = own();
        o.depreciation_years = 0.0;
        let e = compare(&o, 1, 1.0, 0.0, &[]).unwrap_err().to_string();
        assert!(e.contains("depreciation_years = 0"), "{e}");
        o = own();
        o.price_per_kwh = f64::NAN;
        assert!(
            o.validate()
                .unwrap_err()
                .to_string()
                .contains("price_per_kwh")
        );
        let e = compare(&own(), 0, 1.0, 0.0, &[]).unwrap_err().to_string();
        assert!(e.contains("fleet_gpus"), "{e}");
    }
}
