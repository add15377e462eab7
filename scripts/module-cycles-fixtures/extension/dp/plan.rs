pub enum Stage {
    One,
}
