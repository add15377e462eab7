mod b;
mod c;
