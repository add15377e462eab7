//! The strategy's configuration table.

use std::cell::OnceCell;

use serde::de::DeserializeOwned;

use crate::Error;

/// The plugin's configuration (the strategy's `compressor_config`,
/// `batch_policy_config` or `checkpoint_config` table, or `--plugin-config`
/// keys), as the host
/// hands it to `configure` (TOML text).
///
/// The text is parsed on first use, so a plugin that reads no configuration
/// carries no TOML parser.
///
/// ```
/// # use harness_sdk::Config;
/// let config = Config::new("ratio = 0.01\nwarmup = 10");
/// assert_eq!(config.get::<f64>("ratio").unwrap(), Some(0.01));
/// assert_eq!(config.get_or("seed", 7u64).unwrap(), 7);
/// ```
#[derive(Debug, Clone)]
pub struct Config {
    text: String,
    table: OnceCell<Result<toml::Table, Error>>,
}

impl Config {
    /// A configuration from TOML text (not parsed yet).
    pub fn new(text: impl Into<String>) -> Config {
        Config { text: text.into(), table: OnceCell::new() }
    }

    /// The TOML text as the host sent it.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The parsed table, or why the text is not valid TOML.
    pub fn table(&self) -> Result<&toml::Table, Error> {
        self.table
            .get_or_init(|| self.text.parse::<toml::Table>().map_err(|e| Error::new(format!("config is not valid TOML: {e}"))))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The whole table as a `T` (use `#[serde(deny_unknown_fields)]` on `T`
    /// to reject unknown keys).
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, Error> {
        self.table()?;
        toml::from_str(&self.text).map_err(|e| Error::new(format!("invalid config: {}", e.message())))
    }

    /// The value of `key` as a `T`, `None` when the key is absent.
    pub fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, Error> {
        match self.table()?.get(key) {
            None => Ok(None),
            Some(value) => value.clone().try_into().map(Some).map_err(|e| Error::new(format!("config key `{key}`: {}", e.message()))),
        }
    }

    /// The value of `key` as a `T`, `default` when the key is absent.
    pub fn get_or<T: DeserializeOwned>(&self, key: &str, default: T) -> Result<T, Error> {
        Ok(self.get(key)?.unwrap_or(default))
    }

    /// Fails naming the first key that is not in `known` (catches typos in
    /// suites).
    pub fn check_keys(&self, known: &[&str]) -> Result<(), Error> {
        match self.table()?.keys().find(|k| !known.contains(&k.as_str())) {
            None => Ok(()),
            Some(k) if known.is_empty() => Err(Error::new(format!("unknown config key `{k}` (this plugin takes no settings)"))),
            Some(k) => Err(Error::new(format!("unknown config key `{k}` (known: {})", known.join(", ")))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct TopK {
        ratio: f64,
        #[serde(default)]
        warmup: u32,
    }

    #[test]
    fn get_reads_typed_values() {
        let c = Config::new("ratio = 0.01\nwarmup = 10\nmode = \"nan\"\nint_as_float = 3\n[nested]\nx = 1\n");
        assert_eq!(c.get::<f64>("ratio").unwrap(), Some(0.01));
        assert_eq!(c.get::<u32>("warmup").unwrap(), Some(10));
        assert_eq!(c.get::<String>("mode").unwrap().as_deref(), Some("nan"));
        assert_eq!(c.get::<f64>("int_as_float").unwrap(), Some(3.0));
        assert_eq!(c.get::<u32>("absent").unwrap(), None);
        assert_eq!(c.get_or("absent", 5u32).unwrap(), 5);
        assert_eq!(c.get::<toml::Table>("nested").unwrap().unwrap()["x"].as_integer(), Some(1));
    }

    #[test]
    fn get_reports_the_key_on_a_type_error() {
        let c = Config::new("warmup = \"ten\"\nneg = -1");
        let e = c.get::<u32>("warmup").unwrap_err();
        assert!(e.message().starts_with("config key `warmup`: "), "{e}");
        assert!(c.get::<u32>("neg").unwrap_err().message().contains("`neg`"));
    }

    #[test]
    fn parse_deserializes_the_table() {
        assert_eq!(Config::new("ratio = 0.5").parse::<TopK>().unwrap(), TopK { ratio: 0.5, warmup: 0 });
        let e = Config::new("ratio = 0.5\nratoi = 1").parse::<TopK>().unwrap_err();
        assert!(e.message().contains("ratoi"), "{e}");
        assert!(Config::new("").parse::<TopK>().unwrap_err().message().contains("ratio"));
    }

    #[test]
    fn empty_text_is_an_empty_table() {
        let c = Config::new("");
        assert!(c.table().unwrap().is_empty());
        assert_eq!(c.get::<u32>("x").unwrap(), None);
        c.check_keys(&[]).unwrap();
    }

    #[test]
    fn invalid_toml_is_an_error_on_use() {
        let c = Config::new("ratio = = 1");
        assert!(c.table().unwrap_err().message().starts_with("config is not valid TOML"));
        assert!(c.get::<u32>("ratio").is_err());
        assert!(c.parse::<TopK>().is_err());
        assert_eq!(c.text(), "ratio = = 1");
    }

    #[test]
    fn check_keys_names_the_unknown_key() {
        let c = Config::new("mode = \"ok\"\nevry = 3");
        let e = c.check_keys(&["mode", "every"]).unwrap_err();
        assert_eq!(e.message(), "unknown config key `evry` (known: mode, every)");
        c.check_keys(&["mode", "evry"]).unwrap();
        assert_eq!(c.check_keys(&[]).unwrap_err().message(), "unknown config key `evry` (this plugin takes no settings)");
    }
}
